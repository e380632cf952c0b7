"""Small random-weight PEFT LoRA adapters, built offline for tests and benchmarks.

`build_lora_adapter(model_dir, out_dir, seed=...)` wraps the HF model in
`model_dir` with PEFT (`LoraConfig` + `get_peft_model`), draws every
`lora_A` and `lora_B` from a seeded generator and saves the adapter with
`save_pretrained` (`adapter_config.json` + `adapter_model.safetensors`).

Why the weights are drawn, not PEFT's defaults: PEFT starts `lora_B` at zero,
so a fresh adapter changes nothing and an equality with the base model would
prove nothing. `std` is chosen so greedy outputs differ from the base model's
(`tests/test_lora_engine.py` checks that they do before trusting an equality).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

# q/k/v/o and the MLP projections of the Llama family.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    std: float = 0.1,
    target_modules: Sequence[str] = ALL_PROJECTIONS,
    **config: Any,
) -> Path:
    """Save a random LoRA adapter for `model_dir` into `out_dir` and return `out_dir`.

    Same arguments give the same weights. `config` goes into `LoraConfig`
    (e.g. `use_rslora=True`, or an unsupported `use_dora=True` for refusal tests).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        lora = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(target_modules),
            lora_dropout=0.0,
            init_lora_weights=True,
            **config,
        )
        model = get_peft_model(base, lora)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.save_pretrained(out_dir)
    return Path(out_dir)


def load_peft_reference(model_dir: Path, adapter_dir: Path) -> PreTrainedModel:
    """The HF model in `model_dir` with the PEFT adapter applied, float32, SDPA, eval mode."""
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    return model  # type: ignore[return-value]


@torch.no_grad()
def peft_greedy(model: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Exactly `max_new_tokens` greedy tokens (EOS included, as with `ignore_eos`), by a
    plain forward over the whole sequence per token: PEFT's `generate` stops at EOS
    whatever the generation config says."""
    forward: Any = model
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = forward(input_ids=torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
