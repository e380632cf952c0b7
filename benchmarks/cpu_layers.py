"""The decoder's elementwise layers in C against torch's operations, per call.

pagefleet's CPU float32 fast path runs RMSNorm, the MLP's SiLU and product,
and RoPE with the step's K/V write in C (`pagefleet/kernels/cpu_layers.c`),
and the sampler's greedy picks over the step's logits. This script times each
against the torch operations it replaces, at SmolLM2-135M's shapes (hidden
576, 9 query and 3 KV heads of 64, MLP 1,536, vocabulary 49,152; the greedy
picks over as many logits rows as the step's rows, at most 256) for a decode
step's rows and a prefill chunk's, one thread, median of interleaved rounds,
CPU time, and checks every output bit for bit against torch's. The ratio
column is torch's time over pagefleet's.

    python benchmarks/cpu_layers.py [--rows 32 2048] [--rounds 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagefleet.kernels.cpu_layers import layer_kernels
from pagefleet.kernels.reference import write_kv_reference
from pagefleet.worker.llama import RMSNorm, rotate
from pagefleet.worker.sampler import torch_greedy_picks

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INNER, BLOCK, VOCAB = 576, 9, 3, 64, 1536, 16, 49152


def cpu_ms(fn: Callable[[], Any], calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e3


def cases(rows: int) -> list[tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], bool]]]:
    """(layer, torch's version, pagefleet's, its bits equal torch's) at `rows` rows."""
    kernels = layer_kernels()
    if kernels is None:
        raise SystemExit("the C library did not build (no C compiler?)")
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    norm = RMSNorm(HIDDEN, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN, generator=gen))

    heads = Q_HEADS + 2 * KV_HEADS
    qkv = torch.randn(rows, heads * HEAD_DIM, generator=gen).view(rows, heads, HEAD_DIM)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.randint(0, 8192, (rows,), generator=gen)[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    blocks = -(-rows // BLOCK) * 4
    caches = {who: (torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM),
                    torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM)) for who in ("torch", "C")}  # fmt: skip
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:rows]

    def rope_torch() -> torch.Tensor:
        q, k, v = qkv.split((Q_HEADS, KV_HEADS, KV_HEADS), dim=-2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        write_kv_reference(k.contiguous(), v.contiguous(), *caches["torch"], slots)
        return q.contiguous()

    def rope_c() -> torch.Tensor:
        return kernels.rope_write(qkv, cos, sin, Q_HEADS, *caches["C"], slots)

    gate_up = torch.randn(rows, 2 * INNER, generator=gen) * 3

    def silu_torch() -> torch.Tensor:
        gate, up = gate_up.split(INNER, dim=-1)
        out = F.silu(gate)
        return out.mul_(up)

    logits = torch.randn(min(rows, 256), VOCAB, generator=gen)

    def greedy_torch() -> list[int]:
        return torch_greedy_picks(logits)

    out: list[tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], bool]]] = [
        ("RMSNorm", lambda: norm(hidden), lambda: kernels.rms_norm(hidden, norm.weight, 1e-5),
         lambda: torch.equal(norm(hidden), kernels.rms_norm(hidden, norm.weight, 1e-5))),
        ("RoPE of q and k, K/V write", rope_torch, rope_c,
         lambda: torch.equal(rope_torch(), rope_c())
         and all(torch.equal(a, b) for a, b in zip(caches["torch"], caches["C"], strict=True))),
        ("SiLU and product", silu_torch, lambda: kernels.silu_mul(gate_up, INNER),
         lambda: torch.equal(silu_torch(), kernels.silu_mul(gate_up, INNER))),
        ("greedy picks (logits rows)", greedy_torch, lambda: kernels.greedy(logits),
         lambda: greedy_torch() == kernels.greedy(logits)),
    ]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"SmolLM2-135M shapes, float32, {args.threads} thread(s), CPU ms a call, median of "
          f"{args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'layer':32s} {'rows':>5s} {'torch':>9s} {'pagefleet':>9s} {'ratio':>7s}  bits equal")
    for rows in args.rows:
        calls = max(3, 20_000 // rows)
        for name, torch_fn, c_fn, same in cases(rows):
            times: dict[str, list[float]] = {"torch": [], "C": []}
            for fn in (torch_fn, c_fn):
                fn()  # warm
            for _ in range(args.rounds):
                times["torch"].append(cpu_ms(torch_fn, calls))
                times["C"].append(cpu_ms(c_fn, calls))
            t, c = (statistics.median(times[k]) for k in ("torch", "C"))
            print(f"{name:32s} {rows:5d} {t:9.4f} {c:9.4f} {t / c:7.2f}x  {same()}")


if __name__ == "__main__":
    main()
