"""The offline API as users call it: `from pagefleet import LLM, SamplingParams`."""

from __future__ import annotations

import pytest

from pagefleet import LLM, RequestOutput, SamplingParams
from pagefleet.worker.engine import RequestError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", num_kv_blocks=64)


def test_generate_returns_one_output_per_prompt_in_order(llm: LLM) -> None:
    prompts = ["Hello there", "A much longer prompt about the sea and the ships", "x"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [type(o) for o in outs] == [RequestOutput] * 3
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert [c.token_ids for c in out.outputs] == [out.token_ids]


def test_a_single_string_or_token_list_is_one_prompt(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    by_text = llm.generate("Hello there", params)
    by_ids = llm.generate(llm.tokenizer.encode("Hello there"), params)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].token_ids == by_ids[0].token_ids


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)])
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_an_invalid_prompt_fails_the_call_and_leaves_the_pool_clean(llm: LLM) -> None:
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate([[5, 6, 7], []], SamplingParams())
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.num_waiting == 0 and stats.num_running == 0


def test_stats_report_pool_counters_queues_and_preemptions(llm: LLM) -> None:
    llm.generate("Hello there", SamplingParams(max_tokens=20))
    stats = llm.stats()
    for key in ("total", "free", "live", "cached", "peak_live", "prefix_query_tokens",
                "prefix_hit_tokens", "evictions", "num_running", "num_waiting",
                "preemptions_recompute", "preemptions_swap", "swaps_out", "swaps_in"):
        assert hasattr(stats, key)
    assert stats.total == 64 and stats.peak_live >= 2
    assert stats.free + stats.cached == stats.total
