"""Tiny random HF models for the frozen eval, built offline in a temporary directory.

`build_tiny_hf_model("llama" | "qwen2" | "mistral", tmp_dir)` saves a small
random model (with `save_pretrained`) plus the built-in tiny tokenizer and
returns the directory, ready for `ModelRunner(model=dir)` or `LLM(model=dir)`.

Why these settings: with transformers' default `initializer_range` (0.02) a
random model greedily repeats one token, which hides attention bugs. 0.15
gives diverse greedy text; `check_diverse` asserts that before any equality
is trusted. Linear biases are drawn at random too (transformers initialises
them to zero), so Qwen2's biased q/k/v projections actually change the
result.

The reference side (`load_hf_reference`, `hf_greedy`, `top2_gap`) runs HF
with its ordinary contiguous cache and SDPA attention (which, unlike HF eager,
keeps float64 softmax in float64), one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from pagefleet.worker.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tiny_tokenizer

ARCHS = ("llama", "qwen2", "mistral")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}

# Shared shape: GQA (4 query heads over 2 KV heads), tiny enough for CPU float64.
_COMMON: dict[str, Any] = {
    "vocab_size": 1024,  # the tiny tokenizer's vocabulary
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    # Qwen2's q/k/v projections always carry biases.
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False},
    # Mistral defaults to a 4096 window, which no test reaches; pass sliding_window=N
    # to exercise the windowed path.
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": None},
}


def tiny_hf_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The config `build_tiny_hf_model` would use, with `overrides` applied."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kwargs = {**_COMMON, **_ARCH_DEFAULTS[arch], **overrides}
    return _CONFIG_CLASSES[arch](**kwargs)


def build_tiny_hf_model(
    arch: str,
    tmp_dir: Path,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Build a tiny random `arch` model with the tiny tokenizer; return its directory.

    The model is saved in `dtype` under `tmp_dir / f"{arch}-{seed}"`; `overrides`
    go into the config (e.g. `num_hidden_layers=3`, `sliding_window=16`).
    Same arguments give the same weights; different archs get different weights
    for the same seed.
    """
    config = tiny_hf_config(arch, **overrides)
    out_dir = Path(tmp_dir) / f"{arch}-{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * len(ARCHS) + ARCHS.index(arch))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        std = config.initializer_range
        with torch.no_grad():
            for module in model.modules():
                bias = getattr(module, "bias", None)
                if isinstance(module, torch.nn.Linear) and bias is not None:
                    bias.normal_(0.0, std)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(out_dir)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


def load_hf_reference(
    model_dir: Path, dtype: torch.dtype = torch.float64, kv_dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load `model_dir` as plain HF (SDPA attention, ordinary cache) for reference outputs.

    `kv_dtype` (e.g. float16) rounds every key and value through that dtype before
    SDPA reads them, in the model dtype: the contiguous twin of a paged engine whose
    `kv_cache_dtype` stores K/V in it.
    """
    attention = "sdpa"
    if kv_dtype is not None:
        attention = f"sdpa_kv_{str(kv_dtype).removeprefix('torch.')}"
        _register_rounded_sdpa(attention, kv_dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    return model.eval()


def _register_rounded_sdpa(name: str, kv_dtype: torch.dtype) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def rounded(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        key = key.to(kv_dtype).to(query.dtype)
        value = value.to(kv_dtype).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, rounded)
    AttentionMaskInterface.register(name, sdpa_mask)


@torch.no_grad()
def hf_greedy(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_at_eos: bool = False,
) -> list[int]:
    """Greedy continuation of one prompt by HF `generate` with its contiguous cache.

    With `stop_at_eos=False` exactly `max_new_tokens` tokens come back (EOS may
    appear among them), matching an engine run with `ignore_eos=True`.
    """
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID if stop_at_eos else None,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
    )
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    # mypy sees nn.Module.__getattr__ here (Tensor | Module), not GenerationMixin.generate.
    out = cast(Any, model).generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
    )
    return [int(t) for t in out[0, input_ids.shape[1] :]]


@torch.no_grad()
def next_token_logits(model: PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """HF logits `[vocab]` for the token that follows `token_ids` (one full forward)."""
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    # transformers' type stubs make PreTrainedModel look uncallable to mypy.
    forward: Any = model
    logits: torch.Tensor = forward(input_ids).logits
    return logits[0, -1]


def top2_gap(model: PreTrainedModel, token_ids: Sequence[int]) -> float:
    """Gap between the two largest next-token logits after `token_ids` (near-tie check)."""
    top = torch.topk(next_token_logits(model, token_ids).double(), 2).values
    return float(top[0] - top[1])


def check_diverse(token_lists: Sequence[Sequence[int]], min_distinct: int) -> None:
    """Fail unless the reference outputs hold at least `min_distinct` distinct tokens.

    An equality between two runs of a degenerate model (one repeated token)
    proves nothing about attention.
    """
    distinct = {t for tokens in token_lists for t in tokens}
    assert len(distinct) >= min_distinct, (
        f"reference outputs too repetitive to trust: {len(distinct)} distinct tokens "
        f"< {min_distinct}"
    )


def prompt_ids(length: int, seed: int) -> list[int]:
    """A deterministic prompt of `length` token ids (BOS first, no special tokens after)."""
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(3, _COMMON["vocab_size"], (length - 1,), generator=gen)
    return [BOS_ID, *(int(t) for t in body)]
