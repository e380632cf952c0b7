"""Containment in the engine: one request's non-finite logits fail that request alone."""

from __future__ import annotations

import torch

from pagefleet import LLM, SamplingParams
from pagefleet.worker.outputs import RequestOutput

POISON = 7  # a token id whose embedding row is made NaN, as in a corrupt checkpoint


def _run(llm: LLM, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[RequestOutput]]:
    engine = llm.engine
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].append(delta)
    return out


def test_a_request_with_non_finite_logits_fails_alone_and_its_batch_mates_finish() -> None:
    llm = LLM(model="tiny", block_size=4, num_kv_blocks=64, max_model_len=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    good = [3, 4, 5, 6, 8, 9]
    want = _run(llm, {"alone": good}, params)["alone"]
    with torch.no_grad():
        llm.engine.runner.model.get_input_embeddings().weight[POISON] = float("nan")
    got = _run(llm, {"bad": [POISON, 4, 5], "good": good}, params)
    assert got["bad"][-1].finish_reason == "error"
    assert got["bad"][-1].error is not None and "request 'bad' failed" in got["bad"][-1].error
    assert got["good"][-1].finish_reason == "length"
    assert [t for d in got["good"] for t in d.new_token_ids] == [t for d in want for t in d.new_token_ids]
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats
