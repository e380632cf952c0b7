"""Random traffic on a tiny pool: every step keeps the pool consistent, and scheduling
(preemption, chunking, prefix hits, forks, aborts) never changes a greedy answer."""

from __future__ import annotations

import random

import pytest

from pagefleet import LLM, SamplingParams
from pagefleet.worker.engine import LLMEngine


@pytest.fixture(scope="module")
def solo_engine() -> LLMEngine:
    # Plenty of blocks and budget: the reference schedule (no preemption, no chunking).
    return LLM(model="tiny", dtype="float64", num_kv_blocks=256, enable_prefix_caching=False).engine


def solo_tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    engine.add_request("solo", prompt, params)
    final: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.index] = out.token_ids
    return [final[i] for i in range(params.n)]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_traffic_keeps_integrity_and_greedy_answers(
    solo_engine: LLMEngine, mode: str, seed: int
) -> None:
    rng = random.Random(seed)
    llm = LLM(model="tiny", dtype="float64", block_size=8, num_kv_blocks=14,
              max_num_seqs=4, max_num_batched_tokens=24, preemption_mode=mode,
              swap_space_bytes=1 << 20)
    engine = llm.engine
    shared = [rng.randrange(3, 1024) for _ in range(20)]
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    finals: dict[tuple[str, int], list[int]] = {}
    aborted: set[str] = set()
    for step in range(400):
        if len(requests) < 14 and rng.random() < 0.4:
            own = [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 30))]
            prompt = (shared if rng.random() < 0.5 else []) + own
            params = SamplingParams(max_tokens=rng.randrange(1, 20), n=rng.choice([1, 1, 2]),
                                    ignore_eos=True)
            request_id = f"r{len(requests)}"
            requests[request_id] = (prompt, params)
            engine.add_request(request_id, prompt, params, priority=rng.choice([0, 0, 1]))
        if requests and rng.random() < 0.03:
            victim = rng.choice(sorted(requests))
            if engine.abort_request(victim):
                aborted.add(victim)
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                finals[(out.request_id, out.index)] = out.token_ids
        engine.check_integrity()
        if step > 100 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats.preemptions_total > 0, stats
    assert stats.prefix_hit_tokens > 0 and stats.cow_copies > 0, stats
    if mode == "swap":
        assert stats.swaps_in > 0, stats
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats
    for request_id, (prompt, params) in requests.items():
        if request_id in aborted:
            continue
        got = [finals[(request_id, i)] for i in range(params.n)]
        assert got == solo_tokens(solo_engine, prompt, params), request_id
