"""Engine throughput on SmolLM2-135M-Instruct against HF `generate`, same device and dtype.

GPU (what `benchmarks/gpu_check.sh` runs)::

    python benchmarks/gpu_engine.py --device cuda --dtype bfloat16

Workload: 32 requests, prompt lengths drawn from 50-400 tokens (seeded, token
ids from the model's vocabulary), 64 output tokens each, greedy, EOS ignored.
Peers in this process, on the same requests, after one warm-up call each
(CUDA context, Triton compilation):

- HF `generate` on one left-padded batch (contiguous cache, SDPA);
- pagefleet `LLM.generate` (paged KV, Triton kernels on CUDA).

Prints output tokens/s of each, the ratio, and how many requests' greedy
tokens agree (informational: bf16 rounding differs between the two paths).
`--smoke`: 4 requests of 8 tokens on CPU in float32, for the tests.
Needs torch, transformers, gguf and this checkout; no Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def workload(n: int, lo: int, hi: int, out_len: int, vocab: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [
        ([int(t) for t in torch.randint(100, vocab, (length,), generator=gen)], out_len)
        for length in lengths
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_padded(model: Any, reqs: list[tuple[list[int], int]], device: torch.device, pad: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p, _ in reqs)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in reqs], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs], device=device)
    n = max(o for _, o in reqs)
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
        pad_token_id=pad,
    )
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, [row[width:].tolist() for row in out]


def pagefleet_run(llm: Any, reqs: list[tuple[list[int], int]], device: torch.device) -> tuple[float, list[list[int]]]:
    from pagefleet import SamplingParams

    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    sync(device)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="4 short requests, CPU, float32")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.dtype, args.requests = "cpu", "float32", 4
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagefleet import LLM
    from pagefleet.worker.kv_cache import parse_dtype
    from pagefleet.worker.model_files import resolve_model_path

    hf_logging.disable_progress_bar()
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    model_dir = resolve_model_path("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    vocab, pad = int(hf.config.vocab_size), int(hf.generation_config.pad_token_id or 0)
    lo, hi, out_len = (20, 60, 8) if args.smoke else (50, 400, 64)
    reqs = workload(args.requests, lo, hi, out_len, vocab)
    llm = LLM(model=str(model_dir), dtype=args.dtype, device=args.device,
              max_num_seqs=len(reqs))  # fmt: skip
    warm = [(reqs[0][0][:16], 2), (reqs[1][0][:24], 2)]
    hf_padded(hf, warm, device, pad)
    pagefleet_run(llm, warm, device)
    hf_s, hf_out = hf_padded(hf, reqs, device, pad)
    pf_s, pf_out = pagefleet_run(llm, reqs, device)
    useful = sum(o for _, o in reqs)
    agree = sum(a[:o] == b for a, b, (_, o) in zip(hf_out, pf_out, reqs, strict=True))
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {card}; {len(reqs)} requests, "
          f"{sum(len(p) for p, _ in reqs)} prompt tokens, {useful} output tokens")  # fmt: skip
    print()
    print("| method | seconds | output tok/s | vs HF padded |")
    print("|---|---|---|---|")
    print(f"| HF generate, padded batch | {hf_s:.2f} | {useful / hf_s:.1f} | 1.00x |")
    print(f"| pagefleet LLM.generate | {pf_s:.2f} | {useful / pf_s:.1f} | {hf_s / pf_s:.2f}x |")
    print()
    print(f"greedy agreement: {agree}/{len(reqs)} requests token for token "
          f"(informational in {args.dtype})")  # fmt: skip
    llm.check_integrity()


if __name__ == "__main__":
    main()
