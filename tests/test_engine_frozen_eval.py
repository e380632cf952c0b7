"""Frozen eval: paging changes no answer.

Greedy outputs of the paged engine must equal HF `generate` with its ordinary
contiguous cache, token for token, for Llama (GQA), Qwen2 (biases) and
Mistral tiny random models, in float64 (identical) and float32 (a divergence
only at a near-tie), under every scheduling situation the engine has:
block sizes 8/16/32, requests arriving mid-run, preemption in each mode,
chunked prefill and prefix-cache hits. After every scenario the pool is
consistent and every block is free or cached.

A float16 KV cache (`kv_cache_dtype`) is compared with HF rounding every key
and value through float16 before its SDPA: identical in float64, a divergence
only at a near-tie in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf_models import (
    ARCHS,
    build_tiny_hf_model,
    check_diverse,
    hf_greedy,
    load_hf_reference,
    next_token_logits,
    prompt_ids,
    top2_gap,
)

from pagefleet import LLM, SamplingParams

MAX_NEW = 16
# Block boundaries of 8, 16 and 32 and one either side, plus a few in between.
PROMPT_LENGTHS = (1, 2, 5, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 40, 63, 64, 65)
SHARED_PREFIX_LEN = 40
SUFFIX_LENGTHS = (1, 7, 8, 25)
NEAR_TIE = 1e-4
# Preemption serialises the batch (few sequences fit), so it runs on a subset that
# still spans block boundaries and the longest prompts.
PREEMPTION_SUBSET = (0, 4, 5, 7, 8, 12, 15, 16)


@dataclass
class Reference:
    arch: str
    model_dir: Path
    prompts: list[list[int]]
    expected: list[list[int]]
    prefix_prompts: list[list[int]]
    prefix_expected: list[list[int]]


@pytest.fixture(scope="module", params=ARCHS)
def ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    arch = request.param
    model_dir = build_tiny_hf_model(arch, tmp_path_factory.mktemp(arch))
    hf = load_hf_reference(model_dir)
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    shared = prompt_ids(SHARED_PREFIX_LEN, seed=100)
    prefix_prompts = [shared + prompt_ids(n + 1, seed=200 + n)[1:] for n in SUFFIX_LENGTHS]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    prefix_expected = [hf_greedy(hf, p, MAX_NEW) for p in prefix_prompts]
    check_diverse(expected, min_distinct=60)
    return Reference(arch, model_dir, prompts, expected, prefix_prompts, prefix_expected)


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def assert_same_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i}: paged output {g} != HF generate {e}"


def assert_pool_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0, stats
    assert stats.free + stats.cached == stats.total, stats


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_greedy_equals_hf_generate_float64(ref: Reference, block_size: int) -> None:
    llm = LLM(model=ref.model_dir, block_size=block_size, dtype="float64")
    assert_same_tokens(generate(llm, ref.prompts), ref.expected)
    assert_pool_clean(llm)


def test_greedy_equals_hf_with_requests_arriving_mid_run(ref: Reference) -> None:
    llm = LLM(model=ref.model_dir, dtype="float64")
    engine = llm.engine
    arrivals = {0: range(0, 5), 2: range(5, 9), 5: range(9, 13), 11: range(13, len(ref.prompts))}
    got: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, ()):
            engine.add_request(str(i), ref.prompts[i], GREEDY)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        step += 1
    assert_same_tokens([got[str(i)] for i in range(len(ref.prompts))], ref.expected)
    assert_pool_clean(llm)


def _small_pool(ref: Reference, mode: str) -> LLM:
    """12 blocks of 8 tokens in float64, no prefix cache, preempting by `mode`."""
    return LLM(
        model=ref.model_dir,
        block_size=8,
        num_kv_blocks=12,
        dtype="float64",
        preemption_mode=mode,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_greedy_equals_hf_under_preemption(ref: Reference, mode: str) -> None:
    # 12 blocks of 8 tokens: the longest request alone needs 11, so the batch must preempt.
    llm = _small_pool(ref, mode)
    assert_same_tokens(generate(llm, ref.prompts), ref.expected)
    stats = llm.stats()
    assert stats.preemptions_total > 0, stats
    if mode == "swap":
        assert stats.preemptions_swap > 0 and stats.swaps_in == stats.swaps_out, stats
    if mode == "recompute":
        assert stats.preemptions_swap == 0, stats
    assert_pool_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_hf_when_later_higher_priorities_preempt(ref: Reference, mode: str) -> None:
    # Each wave outranks the one before and arrives to a full pool: it preempts them.
    llm = _small_pool(ref, mode)
    engine = llm.engine
    waves = {0: range(0, 5), 3: range(5, 9), 6: range(9, len(ref.prompts))}
    got: dict[str, list[int]] = {}
    step = 0
    while step <= max(waves) or engine.has_unfinished_requests():
        for priority, (at, ids) in enumerate(waves.items()):
            if at == step:
                for i in ids:
                    engine.add_request(str(i), ref.prompts[i], GREEDY, priority=priority)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        step += 1
    assert_same_tokens([got[str(i)] for i in range(len(ref.prompts))], ref.expected)
    assert llm.stats().preemptions[mode] > 0
    assert_pool_clean(llm)


def test_greedy_equals_hf_with_chunked_prefill(ref: Reference) -> None:
    # A 12-token budget splits every prompt longer than 12 into chunks across steps,
    # and chunk ends fall at every offset within a block of 16.
    llm = LLM(model=ref.model_dir, dtype="float64", max_num_batched_tokens=12)
    assert_same_tokens(generate(llm, ref.prompts), ref.expected)
    assert_pool_clean(llm)


def test_greedy_equals_hf_on_prefix_cache_hits(ref: Reference) -> None:
    llm = LLM(model=ref.model_dir, block_size=8, dtype="float64")
    first = generate(llm, ref.prefix_prompts[:1])
    rest = generate(llm, ref.prefix_prompts[1:])
    assert_same_tokens(first + rest, ref.prefix_expected)
    stats = llm.stats()
    # The 40-token shared prefix is 5 full blocks of 8: each later prompt hits them.
    assert stats.prefix_hit_tokens >= SHARED_PREFIX_LEN * (len(SUFFIX_LENGTHS) - 1), stats
    assert_pool_clean(llm)


@pytest.fixture(scope="module")
def llama_float32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model_dir = build_tiny_hf_model("llama", tmp_path_factory.mktemp("f32"), dtype=torch.float32)
    return model_dir, load_hf_reference(model_dir, dtype=torch.float32)


def test_float32_diverges_from_hf_only_at_near_ties(
    llama_float32: tuple[Path, torch.nn.Module],
) -> None:
    model_dir, hf = llama_float32
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS) if i % 2 == 0]
    llm = LLM(model=model_dir, block_size=16, dtype="float32", max_num_batched_tokens=40)
    assert_equal_but_at_near_ties(hf, prompts, generate(llm, prompts), "float32 output", "HF's")
    assert_pool_clean(llm)


def assert_equal_but_at_near_ties(
    hf: torch.nn.Module, prompts: list[list[int]], got: list[list[int]], what: str, whose: str
) -> None:
    """Each output equals HF's greedy one, or leaves it where HF's top-2 logits nearly tie."""
    for prompt, tokens in zip(prompts, got, strict=True):
        expected = hf_greedy(hf, prompt, MAX_NEW)
        if tokens == expected:
            continue
        at = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        gap = top2_gap(hf, prompt + expected[:at])
        assert gap < NEAR_TIE, (
            f"{what} diverges at generated token {at} where {whose} top-2 logit gap is "
            f"{gap:.3g} (not a near-tie): {tokens} != {expected}"
        )


@pytest.fixture(scope="module")
def llama_float64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model("llama", tmp_path_factory.mktemp("f64"))


def test_float16_kv_equals_hf_on_float16_rounded_kv_in_float64(llama_float64: Path) -> None:
    hf = load_hf_reference(llama_float64, kv_dtype=torch.float16)
    plain = load_hf_reference(llama_float64)
    llm = LLM(model=llama_float64, block_size=16, dtype="float64", kv_cache_dtype="float16")
    assert llm.engine.kv.cache.tensor.dtype == torch.float16
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    check_diverse(expected, min_distinct=60)
    assert_same_tokens([o.token_ids for o in outs], expected)
    # The first token's log-probability (reported in float32): HF's on the rounded K/V,
    # and measurably not HF's on the unrounded K/V (the cache really is float16).
    drift = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].logprobs is not None
        got = out.outputs[0].logprobs[0].logprob
        token = out.token_ids[0]
        rounded = float(torch.log_softmax(next_token_logits(hf, prompt), -1)[token])
        unrounded = float(torch.log_softmax(next_token_logits(plain, prompt), -1)[token])
        assert got == pytest.approx(rounded, abs=1e-6)
        drift = max(drift, abs(got - unrounded))
    assert drift > 1e-4, "float16 KV changed no log-probability: is the cache really float16?"
    assert_pool_clean(llm)


def test_float16_kv_in_float32_diverges_from_rounded_hf_only_at_near_ties(
    llama_float32: tuple[Path, torch.nn.Module],
) -> None:
    model_dir, _ = llama_float32
    hf = load_hf_reference(model_dir, dtype=torch.float32, kv_dtype=torch.float16)
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS) if i % 2 == 0]
    llm = LLM(model=model_dir, block_size=16, dtype="float32", kv_cache_dtype="float16",
              max_num_batched_tokens=40)
    assert_equal_but_at_near_ties(
        hf, prompts, generate(llm, prompts), "float16-KV output", "the rounded HF's"
    )
    assert_pool_clean(llm)
