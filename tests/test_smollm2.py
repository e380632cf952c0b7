"""The real model: SmolLM2-135M-Instruct from its GGUF, answered and checked against HF.

Greedy paged output must equal HF `generate` (contiguous cache, SDPA) on the
same weights, in float32, with prompts that share a prefix, a pool small
enough to preempt and a token budget small enough to chunk every prefill; and
with a random-weight LoRA adapter on every projection, equal to HF + PEFT in a
batch that mixes the adapter and the base model. A differing token is
accepted only where the reference's own top-2 logits are a near-tie,
measured at that position (see `assert_greedy_equal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import load_hf_reference, top2_gap
from lora_adapters import build_lora_adapter, load_peft_reference, peft_greedy
from smollm2 import smollm2_dir
from transformers import DynamicCache, PreTrainedModel

from pagefleet.cli import main
from pagefleet.worker.chat import chat_prompt
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams

BLOCK_SIZE = 16
# Three ~30-token prompts sharing their first block, each growing to 3 blocks:
# 7 blocks at the end, so a 6-block pool must preempt during decode.
NUM_KV_BLOCKS = 6
# Smaller than every prompt: each prefill runs in chunks.
MAX_BATCHED_TOKENS = 24
MAX_NEW_TOKENS = 16
# PEFT's reference runs a full forward per token (no cache): a few seconds for 8.
LORA_NEW_TOKENS = 8
# float32 logits of this 30-layer model differ between the paged path and HF by
# float rounding only; a top-2 gap below this is a tie that rounding can flip.
NEAR_TIE = 1e-3
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
QUESTIONS = ("What is the capital of France?", "Name a primary color.", "Who wrote Hamlet?")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        model=str(smollm2_dir()),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=len(QUESTIONS),
        dtype="float32",
    )


@pytest.fixture(scope="module")
def hf() -> PreTrainedModel:
    return load_hf_reference(smollm2_dir(), dtype=torch.float32)


def _chat(llm: LLM, question: str) -> list[int]:
    prompt = chat_prompt([SYSTEM, {"role": "user", "content": question}], llm.tokenizer)
    assert isinstance(prompt, list)
    return prompt


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation with its ordinary contiguous cache, past EOS.

    `generate` would stop at EOS (it falls back to the model's generation
    config); the engine side runs with `ignore_eos`, so this loop does too.
    """
    forward: Any = model
    cache = DynamicCache()
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = forward(ids, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def assert_greedy_equal(
    hf: PreTrainedModel, prompt: Sequence[int], expected: list[int], got: list[int]
) -> None:
    """Equal token for token, or first different where HF's top-2 gap is below NEAR_TIE."""
    if got == expected:
        return
    i = next((k for k, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    assert i is not None, f"lengths differ: {len(expected)} vs {len(got)}"
    gap = top2_gap(hf, [*prompt, *expected[:i]])
    assert gap < NEAR_TIE, (
        f"token {i} differs ({expected[i]} vs {got[i]}) where HF's top-2 gap is {gap:.3g}, "
        f"not a near-tie (< {NEAR_TIE})"
    )


def test_chat_answers_the_capital_of_france_and_stops_at_end_of_turn(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    llm.check_integrity()


def test_paged_greedy_equals_hf_generate_with_shared_prefix_preemption_and_chunks(
    llm: LLM, hf: PreTrainedModel
) -> None:
    prompts = [_chat(llm, q) for q in QUESTIONS]
    assert min(len(p) for p in prompts) > MAX_BATCHED_TOKENS  # every prefill is chunked
    before = llm.stats()
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    stats = llm.stats()
    assert stats.preemptions_total > before.preemptions_total, "no preemption happened"
    assert stats.prefix_hit_tokens > before.prefix_hit_tokens, "no shared prefix was hit"
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(hf, prompt, MAX_NEW_TOKENS)
        assert_greedy_equal(hf, prompt, expected, out.token_ids)
    llm.check_integrity()
    assert stats.free + stats.cached == stats.total


def test_generate_chat_command_answers_with_the_models_template(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args: list[Any] = ["generate", "What is the capital of France?", "--chat"]
    assert main([*args, "--model", str(smollm2_dir()), "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.slow
def test_greedy_output_with_a_lora_adapter_equals_hf_peft_in_a_mixed_batch(
    llm: LLM, tmp_path: Path
) -> None:
    model_dir = smollm2_dir()
    # Small weights: the adapter changes the answers without making this 30-layer model babble.
    adapter = build_lora_adapter(model_dir, tmp_path / "smol", seed=3, rank=8, std=0.05)
    peft = load_peft_reference(model_dir, adapter)
    served = LLM(
        model=str(model_dir), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=32,
        lora_adapters={"smol": adapter},
    )  # fmt: skip
    prompts = [_chat(llm, q) for q in QUESTIONS[:2]]
    params = SamplingParams(max_tokens=LORA_NEW_TOKENS, ignore_eos=True)
    outs = served.generate(prompts * 2, params, adapter=[None, None, "smol", "smol"])
    base, tuned = outs[:2], outs[2:]
    assert [o.token_ids for o in base] != [o.token_ids for o in tuned], "the adapter changes nothing"
    for prompt, out in zip(prompts, tuned, strict=True):
        expected = peft_greedy(peft, prompt, LORA_NEW_TOKENS)
        assert len(set(expected)) > LORA_NEW_TOKENS // 2, f"degenerate reference {expected}"
        assert_greedy_equal(peft, prompt, expected, out.token_ids)
    served.check_integrity()
