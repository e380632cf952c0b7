"""One CPU decode step's attention: the C kernel against per-sequence SDPA, and its parts.

The issue-9 workload at mid-decode: SmolLM2-135M shapes (30 layers, 9 query
heads over 3 KV heads, head dim 64, blocks of 16), 32 sequences whose prompts
(50-400 tokens) took consecutive blocks and whose later blocks were allocated
one step at a time, interleaved between sequences, as the engine does. Every
layer has its own cache, so a step reads its K/V from memory, not from a
cache the previous layer warmed.

Rows, each CPU time per layer (one thread, median over interleaved rounds):
the CPU paged attention with the C decode kernel (`cpu_decode`, the default)
and with it switched off (`PAGEFLEET_CPU_DECODE=off`: one SDPA call per
sequence, the previous path), each on a float32 cache (`kv_cache_dtype`
auto) and on a float16 cache; the parts of the SDPA path on the float32
cache: the slot gather alone, the SDPA calls alone on already gathered K/V,
and SDPA on one-token contexts (the fixed cost of 32 calls); and the floor:
one pass over the K/V bytes the step reads (a sum over a contiguous copy of
them), from memory (each layer its own copy, as the kernel reads them) and
from the CPU's caches (one layer's copy again). `--quick`: 4 layers, 2 rounds.

`--shared-prefix`: the decode step of the shared-prefix workload of section 21 of
docs/benchmarks.md instead: 32 sequences whose first 512 positions are the same 32
blocks, each with 48-96 positions of its own (a 16-64-token suffix and 32 generated
tokens), so the step reads the same prefix blocks 32 times a layer (from the CPU's
caches after the first).

`--prefill`: one prefill chunk instead (the kernel takes every token of a
step: token i of a chunk is one query row over the positions up to its own),
for chunks of 2 to 4,096 tokens, first chunks and chunks after a cached
prefix: the kernel against the SDPA path (`PAGEFLEET_CPU_DECODE=off`) at its
best, the sequence's blocks consecutive so its K/V are a view of the cache
(no gather), CPU time per chunk and layer, one thread, best of the rounds
(`--quick`: chunks of at most 400 tokens).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagefleet.kernels.cpu_attention import paged_attention_cpu
from pagefleet.kernels.cpu_decode import SWITCH_ENV

BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 3, 9, 64


def step_tables(num_seqs: int, generated: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Block tables and context lengths after `generated` decode steps."""
    rng = random.Random(seed)
    prompts = [rng.randint(50, 400) for _ in range(num_seqs)]
    tables, next_block = [], 0
    for p in prompts:
        n = -(-p // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    ctx = list(prompts)
    for _ in range(generated):
        for i in range(num_seqs):
            ctx[i] += 1
            if -(-ctx[i] // BLOCK) > len(tables[i]):
                tables[i].append(next_block)
                next_block += 1
    return tables, ctx


def shared_prefix_tables(num_seqs: int, prefix: int = 512) -> tuple[list[list[int]], list[int]]:
    """Block tables and context lengths of `num_seqs` sequences sharing `prefix` positions
    (the same blocks), each 48-96 positions of its own after them."""
    shared = list(range(prefix // BLOCK))
    tables, ctx, next_block = [], [], len(shared)
    for i in range(num_seqs):
        own = 48 + 48 * i // max(1, num_seqs - 1)
        n = -(-own // BLOCK)
        tables.append(shared + list(range(next_block, next_block + n)))
        next_block += n
        ctx.append(prefix + own)
    return tables, ctx


# (chunk tokens, cached tokens before it) for --prefill.
PREFILL_CHUNKS = [(2, 0), (16, 0), (100, 0), (400, 0), (1024, 0), (2048, 0), (4096, 0),
                  (40, 512), (64, 512), (2048, 6144)]


def prefill(rounds: int, quick: bool) -> None:
    """One prefill chunk per shape, the C kernel against SDPA on a view of the cache
    (`quick`: the chunks of at most 400 tokens)."""
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'chunk':>6s} {'cached':>7s} {'SDPA ms':>9s} {'kernel ms':>10s} {'SDPA/kernel':>12s}")
    for chunk, cached in PREFILL_CHUNKS:
        if quick and chunk > 400:
            continue
        ctx = cached + chunk
        blocks = -(-ctx // BLOCK)
        k_cache, v_cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
        query = torch.randn(chunk, Q_HEADS, HEAD_DIM)
        tables = torch.arange(blocks, dtype=torch.int32)[None, :]
        qsl = torch.tensor([0, chunk], dtype=torch.int32)
        lens = torch.tensor([ctx], dtype=torch.int32)
        best: dict[str, float] = {}
        for _ in range(rounds):
            for switch in ("off", "on"):
                os.environ[SWITCH_ENV] = switch
                reps = max(1, int(2e5 // (chunk * ctx)))
                start = time.process_time()
                for _ in range(reps):
                    paged_attention_cpu(query, k_cache, v_cache, tables, qsl, lens, HEAD_DIM**-0.5)
                took = (time.process_time() - start) / reps * 1e3
                best[switch] = min(best.get(switch, took), took)
        os.environ.pop(SWITCH_ENV)
        print(f"{chunk:6d} {cached:7d} {best['off']:9.3f} {best['on']:10.3f} "
              f"{best['off'] / best['on']:11.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 2 rounds")
    parser.add_argument("--prefill", action="store_true", help="prefill chunks, not a decode step")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="a decode step whose sequences share a 512-token prefix")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.layers = 2, 4
    torch.set_num_threads(1)
    if args.prefill:
        prefill(args.rounds, args.quick)
        return
    tables, ctx = shared_prefix_tables(32) if args.shared_prefix else step_tables(32, 32)
    num_blocks = max(b for t in tables for b in t) + 1
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    layers = args.layers
    cache32 = torch.randn(layers, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    cache16 = cache32.half()
    query = torch.randn(len(ctx), Q_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    slots = [
        (torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:c]
        for t, c in zip(tables, ctx, strict=True)
    ]
    gathered = [
        [(cache32[i, 0].view(-1, KV_HEADS, HEAD_DIM)[s], cache32[i, 1].view(-1, KV_HEADS, HEAD_DIM)[s])
         for s in slots]
        for i in range(layers)
    ]
    print(f"{len(ctx)} sequences, {sum(ctx)} cached tokens, {layers} layers: "
          f"{cache32[0].nbytes / 1e6:.1f} MB of float32 K/V per layer")

    # The bytes each layer's step reads, one copy per layer: summing them all streams them
    # from memory, as the kernel reads its layers' caches; one layer's copy read again and
    # again stays in the CPU's caches.
    reads = [torch.cat([torch.cat(kv) for kv in gathered[i]]) for i in range(layers)]
    read = reads[0]

    def attention(cache: torch.Tensor, fused: bool) -> Callable[[], None]:
        def run() -> None:
            os.environ[SWITCH_ENV] = "on" if fused else "off"
            for i in range(layers):
                paged_attention_cpu(query, cache[i, 0], cache[i, 1], block_tables, qsl, lens, scale)
        return run

    def gather() -> None:
        for i in range(layers):
            k_flat = cache32[i, 0].view(-1, KV_HEADS, HEAD_DIM)
            v_flat = cache32[i, 1].view(-1, KV_HEADS, HEAD_DIM)
            for s in slots:
                k_flat.index_select(0, s)
                v_flat.index_select(0, s)

    def sdpa(one_token: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(layers):
                for j, (k, v) in enumerate(gathered[i]):
                    if one_token:
                        k, v = k[:1], v[:1]
                    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (query[j : j + 1], k, v))
                    F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)
        return run

    def floor(cached: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(layers):
                (read if cached else reads[i]).sum()
        return run

    methods = {
        "C kernel, float32 KV (auto)": attention(cache32, True),
        "C kernel, float16 KV": attention(cache16, True),
        "per-sequence SDPA, float32 KV": attention(cache32, False),
        "per-sequence SDPA, float16 KV": attention(cache16, False),
        "  float32 part: slot gather only": gather,
        "  float32 part: SDPA only (gathered K/V)": sdpa(False),
        "  float32 part: SDPA fixed cost (1-token contexts)": sdpa(True),
        "one pass over the K/V bytes read, from memory": floor(False),
        "one pass over the K/V bytes read, from the caches": floor(True),
    }
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    per_layer: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            start = time.process_time()
            fn()
            per_layer[name].append((time.process_time() - start) / layers * 1e3)
    os.environ.pop(SWITCH_ENV)
    base = statistics.median(per_layer["per-sequence SDPA, float32 KV"])
    print(f"{read.nbytes / 1e6:.1f} MB of float32 K/V read per layer")
    print(f"\n{'method':52s} {'median ms/layer':>16s} {'min':>7s} {'vs SDPA f32':>12s}")
    for name, values in per_layer.items():
        median = statistics.median(values)
        print(f"{name:52s} {median:16.2f} {min(values):7.2f} {median / base:10.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
