"""Logprobs: the sampled token's log-probability and the top alternatives, from the step's logits."""

from __future__ import annotations

import pytest
import torch
from hf_models import load_hf_reference, next_token_logits

from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import MAX_LOGPROBS, SamplingParams
from pagefleet.worker.tiny_model import ensure_tiny_model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", num_kv_blocks=16)


def test_greedy_logprobs_equal_hf_log_softmax_at_every_position(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    hf = load_hf_reference(ensure_tiny_model(), dtype=torch.float32)
    context = list(out.prompt_token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        expected = torch.log_softmax(next_token_logits(hf, context).float(), dim=-1)
        top = torch.topk(expected, 3)
        assert entry.token_id == token == int(top.indices[0])  # greedy takes the top token
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        context.append(token)
    llm.check_integrity()


def test_sampled_tokens_carry_their_own_logprob_and_zero_asks_for_no_alternatives(
    llm: LLM,
) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPT, params)[0]
    assert out.logprobs is not None
    assert [e.token_id for e in out.logprobs] == out.token_ids
    assert all(e.top == () and e.logprob <= 0.0 for e in out.logprobs)


def test_without_logprobs_the_outputs_carry_none(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2))[0]
    assert out.logprobs is None and out.outputs[0].logprobs is None


def test_logprobs_above_the_limit_are_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=rf"\[0, {MAX_LOGPROBS}\]"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
