"""The linear layers of SmolLM2 on a CPU: plain F.linear against fused and prepacked GEMMs.

Shapes: SmolLM2-135M (hidden 576, intermediate 1536, 9 query / 3 KV heads of
dim 64, vocab 49,152), float32, `--layers` decoder layers (default 30, the
model's; each its own random weights, so a step reads them from memory as the
model does), at `--rows` M (default 32, a decode step of 32 sequences, and
2,048, a prefill chunk of the engine's token budget). The LM head is timed on
its own at 32 rows.

Methods, each over every layer's projections on the same inputs:
- `plain`: `F.linear` per projection (q, k, v, o, gate, up, down), as HF runs them;
- `fused`: `F.linear` with q/k/v in one weight and gate/up in one (4 GEMMs a layer);
- `mkl packed`: the fused weights prepacked for MKL's sgemm
  (`torch.ops.mkl._mkl_reorder_linear_weight` + `torch.ops.mkl._mkl_linear`,
  what inductor emits for float32 with weight prepacking on) through
  pagefleet's own `PackedLinear`, packed once for `PACK_ROWS` (2,048) rows
  and run at every M, as the engine runs them on an Intel CPU; and packed for
  the M of the row itself (what inductor does for a static shape);
- `onednn packed`: the fused weights reordered for oneDNN
  (`torch.ops.mkldnn._reorder_linear_weight` + `torch.ops.mkldnn._linear_pointwise`),
  vLLM's CPU path for float32 (its own handle on the same library), through
  `PackedLinear` as the engine runs them on any other CPU.

Each row: median wall ms per pass over all layers (interleaved rounds,
`--rounds`), the ratio against `plain` in the same process, and whether every
projection's output is bit-identical to plain F.linear (else the largest
absolute difference). Pass `--threads 1` on a shared machine. `--quick`: 2
layers, rows 8 and 64, 3 rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import _engine_bench as common
import torch
import torch.nn.functional as F

from pagefleet.worker.cpu_linear import MKL, ONEDNN, PACK_ROWS, PackedLinear

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
Q, KV = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


@dataclass
class Layer:
    """One decoder layer's weights, `[out, in]` as nn.Linear holds them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @staticmethod
    def random(gen: torch.Generator) -> Layer:
        def w(out: int, inp: int) -> torch.Tensor:
            return torch.randn(out, inp, generator=gen) * inp**-0.5

        return Layer(w(Q, HIDDEN), w(KV, HIDDEN), w(KV, HIDDEN), w(HIDDEN, Q),
                     w(INTERMEDIATE, HIDDEN), w(INTERMEDIATE, HIDDEN), w(HIDDEN, INTERMEDIATE))


# A method runs every layer on (x [M, hidden], x_o [M, q width], x_down [M, intermediate])
# and returns the per-projection outputs of the first layer (for the identity check).
Outputs = dict[str, torch.Tensor]
Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Outputs]


def plain(layers: list[Layer]) -> Method:
    def run(x: torch.Tensor, xo: torch.Tensor, xd: torch.Tensor) -> Outputs:
        first: Outputs = {}
        for i, m in enumerate(layers):
            out = {
                "q": F.linear(x, m.q), "k": F.linear(x, m.k), "v": F.linear(x, m.v),
                "o": F.linear(xo, m.o), "gate": F.linear(x, m.gate), "up": F.linear(x, m.up),
                "down": F.linear(xd, m.down),
            }
            if i == 0:
                first = out
        return first
    return run


def _split(qkv: torch.Tensor, gate_up: torch.Tensor, o: torch.Tensor, down: torch.Tensor) -> Outputs:
    q, k, v = qkv.split([Q, KV, KV], dim=-1)
    gate, up = gate_up.split([INTERMEDIATE, INTERMEDIATE], dim=-1)
    return {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down}


def fused_weights(layers: list[Layer]) -> list[tuple[torch.Tensor, ...]]:
    """(qkv, o, gate_up, down) per layer."""
    return [(torch.cat([m.q, m.k, m.v]), m.o, torch.cat([m.gate, m.up]), m.down) for m in layers]


def fused(layers: list[Layer]) -> Method:
    weights = fused_weights(layers)

    def run(x: torch.Tensor, xo: torch.Tensor, xd: torch.Tensor) -> Outputs:
        first: Outputs = {}
        for i, (qkv, o, gu, down) in enumerate(weights):
            outs = (F.linear(x, qkv), F.linear(x, gu), F.linear(xo, o), F.linear(xd, down))
            if i == 0:
                first = _split(*outs)
        return first
    return run


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    return layer


def mkl_packed(layers: list[Layer], rows: int | None) -> Method:
    """pagefleet's `PackedLinear` (packed for `PACK_ROWS`), or packed for exactly `rows`."""
    mkl = torch.ops.mkl

    def packed(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        if rows is None:
            return PackedLinear(_linear(w), MKL)
        pack = mkl._mkl_reorder_linear_weight(w, rows)
        return lambda x: mkl._mkl_linear(x, pack, w, None, rows)

    modules = [tuple(packed(w) for w in ws) for ws in fused_weights(layers)]

    def run(x: torch.Tensor, xo: torch.Tensor, xd: torch.Tensor) -> Outputs:
        first: Outputs = {}
        for i, (qkv, o, gu, down) in enumerate(modules):
            outs = (qkv(x), gu(x), o(xo), down(xd))
            if i == 0:
                first = _split(*outs)
        return first
    return run


def onednn_packed(layers: list[Layer]) -> Method:
    """pagefleet's `PackedLinear` on oneDNN."""
    modules = [tuple(PackedLinear(_linear(w), ONEDNN) for w in ws) for ws in fused_weights(layers)]

    def run(x: torch.Tensor, xo: torch.Tensor, xd: torch.Tensor) -> Outputs:
        first: Outputs = {}
        for i, (qkv, o, gu, down) in enumerate(modules):
            outs = (qkv(x), gu(x), o(xo), down(xd))
            if i == 0:
                first = _split(*outs)
        return first
    return run


def head_methods(rows: int, gen: torch.Generator) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN**-0.5
    return {
        "plain": lambda x: F.linear(x, w),
        f"mkl packed for {PACK_ROWS} rows (pagefleet's on Intel)": PackedLinear(_linear(w), MKL),
        f"onednn packed for {PACK_ROWS} rows (pagefleet's elsewhere)": PackedLinear(_linear(w), ONEDNN),
    }


def compare(ref: Outputs, got: Outputs) -> str:
    worst = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    identical = all(torch.equal(ref[k], got[k]) for k in ref)
    return "yes" if identical else f"no (max |diff| {worst:.2e})"


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each function over interleaved rounds (after one warm-up call)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="2 layers, rows 8 and 64, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rows, args.rounds = 2, [8, 64], 3
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"SmolLM2 projections, float32, {args.layers} layers, {torch.get_num_threads()} torch "
          f"threads, {args.rounds} rounds; load average at start: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    gen = torch.Generator().manual_seed(0)
    layers = [Layer.random(gen) for _ in range(args.layers)]
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=gen)
        xo = torch.randn(rows, Q, generator=gen)
        xd = torch.randn(rows, INTERMEDIATE, generator=gen)
        methods = {
            "plain F.linear": plain(layers),
            "fused q/k/v, gate/up (F.linear)": fused(layers),
            f"mkl packed for {PACK_ROWS} rows (fused; pagefleet's on Intel)": mkl_packed(layers, None),
            f"mkl packed for M={rows} (fused)": mkl_packed(layers, rows),
            f"onednn packed for {PACK_ROWS} rows (fused; pagefleet's elsewhere)": onednn_packed(layers),
        }
        ref = methods["plain F.linear"](x, xo, xd)
        same = {name: compare(ref, fn(x, xo, xd)) for name, fn in methods.items()}
        times = time_rounds(
            {k: (lambda fn=fn, x=x, xo=xo, xd=xd: fn(x, xo, xd)) for k, fn in methods.items()},
            args.rounds,
        )
        base = times["plain F.linear"]
        for name in methods:
            rows_out.append([str(rows), name, f"{times[name] * 1000:.2f}",
                             f"{base / times[name]:.2f}x", same[name]])
        del methods
    head_rows = min(args.rows)
    x = torch.randn(head_rows, HIDDEN, generator=gen)
    heads = head_methods(head_rows, gen)
    ref_head = heads["plain"](x)
    times = time_rounds({k: (lambda fn=fn: fn(x)) for k, fn in heads.items()}, args.rounds)
    for name, fn in heads.items():
        rows_out.append([str(head_rows), f"LM head, {name}", f"{times[name] * 1000:.2f}",
                         f"{times['plain'] / times[name]:.2f}x",
                         compare({"h": ref_head}, {"h": fn(x)})])
    common.print_table(
        "linear layers of all layers (median wall ms per pass; speed-up against plain F.linear)",
        ["M", "method", "ms", "speed-up", "bit-identical to F.linear"], rows_out,
    )
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
