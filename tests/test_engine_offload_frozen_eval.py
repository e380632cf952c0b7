"""Frozen eval with the offload tier: returning conversations change no answer.

A tiny pool (12 blocks of 8 tokens) serves four conversations: every first
turn runs, then every second turn (the whole history, the first answer and a
new question). The pool cannot keep the first turns' blocks, so without a
tier the second turns recompute them, and with one they are copied back from
host memory. Greedy float64 output must equal HF `generate` (contiguous cache)
token for token in both runs, the tier must actually have been hit, and the
pool must end consistent with every block free or cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hf_models import build_tiny_hf_model, check_diverse, hf_greedy, load_hf_reference, prompt_ids

from pagefleet import LLM, SamplingParams

MAX_NEW = 16
FIRST_LENGTHS = (30, 41, 47, 36)
QUESTION_LEN = 9
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@dataclass
class Conversations:
    model_dir: Path
    firsts: list[list[int]]
    seconds: list[list[int]]
    expected: list[list[int]]  # first-turn answers, then second-turn answers


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory) -> Conversations:
    model_dir = build_tiny_hf_model("llama", tmp_path_factory.mktemp("offload"))
    hf = load_hf_reference(model_dir)
    firsts = [prompt_ids(n, seed=300 + i) for i, n in enumerate(FIRST_LENGTHS)]
    answers = [hf_greedy(hf, p, MAX_NEW) for p in firsts]
    seconds = [
        p + a + prompt_ids(QUESTION_LEN + 1, seed=400 + i)[1:]
        for i, (p, a) in enumerate(zip(firsts, answers, strict=True))
    ]
    expected = answers + [hf_greedy(hf, p, MAX_NEW) for p in seconds]
    check_diverse(expected, min_distinct=40)
    return Conversations(model_dir, firsts, seconds, expected)


def run_two_turns(conv: Conversations, offload_bytes: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=conv.model_dir, block_size=8, num_kv_blocks=12, dtype="float64",
              kv_offload_bytes=offload_bytes)  # fmt: skip
    outs = llm.generate(conv.firsts, GREEDY) + llm.generate(conv.seconds, GREEDY)
    return [o.token_ids for o in outs], llm


def assert_same_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"turn output {i}: paged output {g} != HF generate {e}"


def assert_pool_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0, stats
    assert stats.free + stats.cached == stats.total, stats


def test_second_turns_from_the_offload_tier_equal_hf_generate(conv: Conversations) -> None:
    got, llm = run_two_turns(conv, offload_bytes=8 << 20)
    assert_same_tokens(got, conv.expected)
    stats = llm.stats()
    assert stats.offload_hit_tokens > 0, stats
    assert_pool_clean(llm)


def test_second_turns_recomputed_without_the_tier_equal_hf_generate(conv: Conversations) -> None:
    got, llm = run_two_turns(conv, offload_bytes=0)
    assert_same_tokens(got, conv.expected)
    assert_pool_clean(llm)
