"""Helpers shared by the engine benchmarks (throughput.py, prefix_cache.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch


def build_model(config_kwargs: dict[str, Any], seed: int = 0) -> Path:
    """Save a random Llama with these config values (plus the tiny tokenizer) to a temp dir."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    from pagefleet.worker.tiny_model import build_tiny_tokenizer

    hf_logging.disable_progress_bar()
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False, **config_kwargs,
    )
    out = Path(tempfile.mkdtemp(prefix="pagefleet-bench-"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def prompt(length: int, seed: int, vocab: int = 1024) -> list[int]:
    """A deterministic prompt of random token ids (BOS first, no special ids after)."""
    gen = torch.Generator().manual_seed(seed)
    return [0, *(int(t) for t in torch.randint(3, vocab, (length - 1,), generator=gen))]


def cache_bytes(cache: Any) -> int:
    """Bytes held by an HF cache object (DynamicCache and friends)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A plain fixed-width table on stdout."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
