"""Logit bias, min-p and the repetition, frequency and presence penalties in the batched sampler.

Each is checked against a small reference written here (plain torch on one
row, OpenAI's and HF's definitions) and, for repetition_penalty, against HF's
RepetitionPenaltyLogitsProcessor; then on the tiny model, offline, where a
penalty must change the greedy output and survive a resume on another engine.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagefleet import LLM
from pagefleet.worker.engine import LLMEngine, RequestError
from pagefleet.worker.sampler import TokenHistory, adjust_logits, sample, sampling_probs
from pagefleet.worker.sampling_params import SamplingParams

VOCAB = 50
PROMPT = [3, 7, 7, 11]
OUTPUT = [7, 20, 20, 20, 4]


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def _reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, token by token, as OpenAI documents the penalties and HF the repetition one."""
    out = row.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(logit_bias={7: -100, 30: 5.5}),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4,
                       logit_bias={20: 2.0}),
    ],
)
def test_each_row_is_adjusted_as_the_one_row_reference(params: SamplingParams) -> None:
    logits = _logits(3)
    neutral = SamplingParams()
    histories = [TokenHistory(PROMPT, OUTPUT), TokenHistory([1, 2], [9]), TokenHistory(PROMPT[:2], [])]
    out = adjust_logits(logits, [params, neutral, params], histories)
    assert torch.allclose(out[0], _reference(logits[0], params, PROMPT, OUTPUT))
    assert torch.equal(out[1], logits[1])  # a neutral row in the batch is untouched
    assert torch.allclose(out[2], _reference(logits[2], params, PROMPT[:2], []))


def test_repetition_penalty_matches_hfs_logits_processor() -> None:
    logits = _logits(1)
    ids = torch.tensor([PROMPT + OUTPUT])
    want = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    got = adjust_logits(logits, [SamplingParams(repetition_penalty=1.5)], [TokenHistory(PROMPT, OUTPUT)])
    assert torch.allclose(got, want)


def test_no_adjustment_returns_the_logits_unchanged() -> None:
    logits = _logits(2)
    assert adjust_logits(logits, [SamplingParams(), SamplingParams(min_p=0.5)], None) is logits


def test_a_strong_negative_bias_moves_the_greedy_pick() -> None:
    logits = _logits(1)
    top = int(logits[0].argmax())
    picked = sample(logits, [SamplingParams(logit_bias={top: -100})], [None])
    assert picked[0] is not None and picked[0] != top


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    probs = sampling_probs(row, SamplingParams(temperature=1.0, min_p=0.15))
    # 0.15 * 0.5 = 0.075: tokens of probability 0.06 and 0.04 go, the rest is renormalized.
    assert probs[3:].tolist() == [0.0, 0.0]
    assert torch.allclose(probs[:3], torch.tensor([0.5, 0.3, 0.1]) / 0.9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_p": 1.5}, "min_p must be a number in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number in (0, 2], got 0.0"),
        ({"repetition_penalty": 2.5}, "repetition_penalty must be a number in (0, 2], got 2.5"),
        ({"presence_penalty": 2.1}, "presence_penalty must be a number in [-2, 2], got 2.1"),
        ({"frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2], got -3"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2], got nan"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in [-100, 100], got 101 for token 5"),
        ({"logit_bias": {-1: 1}}, "logit_bias token ids must be integers >= 0, got -1"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias may bias at most 300 tokens, got 301"),
    ],
)
def test_penalty_params_reject_values_outside_their_range_naming_it(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**kwargs)


# ----- on the tiny model, offline ----------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", block_size=4, num_kv_blocks=64, max_model_len=128)


TEXT = "The quick brown fox"


@pytest.mark.parametrize(
    "penalty",
    # The tiny model's greedy output never repeats a token: penalties that favour
    # repeats (below neutral) are the ones that change it.
    [{"repetition_penalty": 0.2}, {"frequency_penalty": -2.0}, {"presence_penalty": -2.0}],
)
def test_a_penalty_changes_the_greedy_output_of_the_tiny_model(llm: LLM, penalty: dict) -> None:
    plain = llm.generate(TEXT, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    penalized = llm.generate(TEXT, SamplingParams(max_tokens=24, ignore_eos=True, **penalty))[0].token_ids
    assert penalized != plain


def test_a_logit_bias_outside_the_vocabulary_is_refused_naming_its_size(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(RequestError, match=rf"logit_bias token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        llm.generate(TEXT, SamplingParams(logit_bias={vocab: 1.0}))


def test_a_resumed_request_counts_its_earlier_output_in_the_penalties(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=-2.0, repetition_penalty=0.5)
    whole = llm.generate(TEXT, params)[0].token_ids
    prompt = list(llm.tokenizer.encode(TEXT))
    # As after a failover or hand-off: the first 8 tokens come back as prompt.
    engine: LLMEngine = llm.engine
    rest = SamplingParams(**{**params.__dict__, "max_tokens": 12})
    engine.add_request("resumed", prompt + whole[:8], rest, num_resumed_tokens=8)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last is not None and whole[:8] + last.token_ids == whole


def test_penalized_greedy_outputs_survive_recompute_preemption(llm: LLM) -> None:
    prompts = [f"{TEXT} {i}" for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=-2.0, repetition_penalty=0.5)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    # 16 blocks of 4 tokens: each request needs 8 of them to finish, so the batch must preempt.
    small = LLM(model="tiny", block_size=4, num_kv_blocks=16, max_model_len=128,
                preemption_mode="recompute", enable_prefix_caching=False)
    together = [out.token_ids for out in small.generate(prompts, params)]
    assert small.stats().preemptions_recompute > 0
    assert together == alone
