"""Benchmark the paged-attention kernels against a copy-bandwidth roofline and contiguous SDPA.

GPU (default when CUDA is present)::

    python benchmarks/paged_attention.py

Decode at batch 1/16/64/256 x context 512/4k/32k (32 q heads, 8 kv heads,
head dim 128, bf16, block size 16) and a mixed prefill+decode batch. For each
shape: a correctness check of the Triton output against the torch reference on
the first sequences (PASS/FAIL), the median time over CUDA events, bytes read
(sum of context x 2 x kv_heads x head_dim x bytes, plus queries and outputs),
achieved GB/s, the fraction of a device-to-device copy's bandwidth measured in
the same run, and torch SDPA over contiguous K/V of the same shapes.

CPU (``--cpu``): the torch reference (the CPU serving path) against SDPA over
contiguous K/V, at a small model's shapes. ``--smoke``: tiny sizes in seconds,
reference path plus one Triton case under the interpreter.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Shape:
    """One benchmark case: per-sequence query and context lengths, and the head layout."""

    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def bytes_read(self) -> int:
        """K/V of every context position once, plus queries read and outputs written."""
        elem = torch.finfo(self.dtype).bits // 8
        kv = sum(self.ctx_lens) * 2 * self.kv_heads * self.head_dim * elem
        q_and_out = 2 * sum(self.q_lens) * self.q_heads * self.head_dim * elem
        return kv + q_and_out


@dataclass
class Row:
    shape: Shape
    check: str
    ms: float | None = None
    peer_ms: float | None = None
    peer_name: str = "sdpa"
    note: str = ""


@dataclass
class Paged:
    """Device tensors of one ``paged_attention`` call."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.context_lens,
        )

    def first(self, n: int) -> Paged:
        """The first ``n`` sequences as a call of their own."""
        end = int(self.query_start_loc[n])
        return Paged(
            self.query[:end],
            self.k_cache,
            self.v_cache,
            self.block_tables[:n],
            self.query_start_loc[: n + 1],
            self.context_lens[:n],
        )


def build_paged(shape: Shape, device: torch.device, seed: int = 0) -> Paged:
    """A random pool whose blocks are handed out in shuffled order (a fragmented pool)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    blocks = [-(-c // bs) for c in shape.ctx_lens]
    num_blocks = sum(blocks)
    max_blocks = max(blocks)
    cache_shape = (num_blocks, bs, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=shape.dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=shape.dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(blocks), max_blocks, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    qsl = [0]
    for q in shape.q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(
        qsl[-1], shape.q_heads, shape.head_dim, generator=gen, device=device, dtype=shape.dtype
    )
    return Paged(
        query,
        k_cache,
        v_cache,
        tables,
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(shape.ctx_lens, dtype=torch.int32, device=device),
    )


def contiguous_kv(paged: Paged, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, kv_heads, ctx, head_dim] K and V for SDPA; all contexts must be equal."""
    ctx = shape.ctx_lens[0]
    if any(c != ctx for c in shape.ctx_lens):
        raise ValueError(f"{shape.name}: the contiguous peer needs equal context lengths")
    blocks = -(-ctx // shape.block_size)
    out = []
    for cache in (paged.k_cache, paged.v_cache):
        gathered = cache[paged.block_tables[:, :blocks].long()]  # [B, nb, bs, H, D]
        gathered = gathered.flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
        out.append(gathered)
        del gathered
    return out[0], out[1]


def time_cuda(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn`` over CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], iters: int) -> float:
    """Fastest milliseconds of ``fn`` on the host clock, after one warm-up.

    The minimum, not the median: on a shared host the median mostly measures
    other processes' scheduling.
    """
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int, timer: Callable[..., float]) -> float:
    """Device-to-device copy bandwidth: bytes read plus bytes written, per second."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def check(
    paged: Paged, out: torch.Tensor, scale: float, num: int, window: int | None = None
) -> tuple[str, float]:
    """Compare the first ``num`` sequences of ``out`` with the torch reference in fp32."""
    from pagefleet.kernels import paged_attention_reference

    sub = paged.first(num)
    ref = paged_attention_reference(
        sub.query.float(),
        sub.k_cache,
        sub.v_cache,
        sub.block_tables,
        sub.query_start_loc,
        sub.context_lens,
        scale,
        sliding_window=window,
    )
    got = out[: sub.query.shape[0]].float()
    err = (got - ref).abs().max().item()
    tol = 2e-2 if paged.query.dtype in (torch.bfloat16, torch.float16) else 1e-4
    ok = bool(torch.isfinite(got).all()) and err <= tol * max(1.0, ref.abs().max().item())
    return ("PASS" if ok else "FAIL"), err


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over contiguous K/V: q [B, Hq, 1, D], k/v [B, Hkv, ctx, D]."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def gpu_shapes() -> list[Shape]:
    shapes = []
    for batch in (1, 16, 64, 256):
        for ctx in (512, 4096, 32768):
            shapes.append(
                Shape(
                    f"decode b{batch} ctx{ctx}",
                    (1,) * batch,
                    (ctx,) * batch,
                    32,
                    8,
                    128,
                    16,
                    torch.bfloat16,
                )
            )
    # Mixed step: 4 prefill chunks of 512 (after 1.5k cached) beside 60 decodes at 4k.
    shapes.append(
        Shape(
            "mixed 4x512 + 60 dec",
            (512,) * 4 + (1,) * 60,
            (2048,) * 4 + (4096,) * 60,
            32,
            8,
            128,
            16,
            torch.bfloat16,
        )
    )
    return shapes


def measure(
    shapes: list[Shape],
    device: torch.device,
    attention: Callable[..., torch.Tensor],
    timer: Callable[[Callable[[], object], int], float],
    iters: int,
) -> list[Row]:
    """Check, time and compare each shape; the same loop on GPU (Triton) and CPU (reference)."""
    rows = []
    for shape in shapes:
        kv_bytes = shape.bytes_read()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # Pool + contiguous copy for SDPA + one gather temporary.
            if 2.6 * kv_bytes > 0.85 * free:
                note = f"skipped: needs ~{2.6 * kv_bytes / 1e9:.0f} GB"
                rows.append(Row(shape, "-", note=note))
                continue
        paged = build_paged(shape, device)
        scale = shape.head_dim**-0.5
        out = torch.full_like(paged.query, float("nan"))
        kernel = functools.partial(
            attention,
            *paged.args(),
            scale,
            max_query_len=max(shape.q_lens),
            max_context_len=max(shape.ctx_lens),
            out=out,
        )
        kernel()
        verdict, err = check(paged, out, scale, min(2, len(shape.q_lens)))
        print(f"{shape.name:26s} check {verdict} (max abs err {err:.2e})", flush=True)
        shape_iters = max(3, iters // 3) if kv_bytes > 8e9 else iters
        row = Row(shape, verdict, ms=timer(kernel, shape_iters))
        if shape.is_decode:
            try:
                k, v = contiguous_kv(paged, shape)
                q4 = paged.query.unsqueeze(2)  # [B, Hq, 1, D]
                peer = functools.partial(sdpa_decode, q4, k, v, scale)
                row.peer_ms = timer(peer, shape_iters)
            except torch.OutOfMemoryError:
                # SDPA backends without GQA support expand K/V per q head.
                row.note = "sdpa peer out of memory"
            k = v = None  # type: ignore[assignment]
        else:
            row.note = "no contiguous peer for a varlen mixed batch"
        rows.append(row)
        del paged, out, kernel
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_gpu(args: argparse.Namespace) -> list[Row]:
    from pagefleet.kernels.triton_attention import paged_attention_triton

    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}", flush=True)
    copy_gbs = copy_bandwidth_gbs(device, 2 << 30, time_cuda)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    rows = measure(gpu_shapes(), device, paged_attention_triton, time_cuda, 30)
    print_table(rows, copy_gbs)
    return rows


def cpu_shapes(smoke: bool) -> list[Shape]:
    # The project's tiny model: 4 q heads, 2 kv heads, head dim 32; fp32 on CPU.
    batches, ctxs = ((1, 4), (32, 128)) if smoke else ((1, 8, 32), (256, 1024, 4096))
    shapes = [
        Shape(f"decode b{b} ctx{c}", (1,) * b, (c,) * b, 4, 2, 32, 16, torch.float32)
        for b in batches
        for c in ctxs
    ]
    chunk, n_dec, dec_ctx = (16, 3, 64) if smoke else (256, 15, 1024)
    shapes.append(
        Shape(
            f"mixed 1x{chunk} + {n_dec} dec",
            (chunk,) + (1,) * n_dec,
            (chunk * 2,) + (dec_ctx,) * n_dec,
            4,
            2,
            32,
            16,
            torch.float32,
        )
    )
    return shapes


def run_cpu(args: argparse.Namespace) -> list[Row]:
    from pagefleet.kernels import paged_attention_reference

    device = torch.device("cpu")
    copy_gbs = copy_bandwidth_gbs(device, (64 << 20) if args.smoke else (512 << 20), time_cpu)
    print(f"cpu copy: {copy_gbs:.1f} GB/s, torch threads: {torch.get_num_threads()}", flush=True)
    iters = 3 if args.smoke else 10
    rows = measure(cpu_shapes(args.smoke), device, paged_attention_reference, time_cpu, iters)
    if args.smoke:
        rows += smoke_triton()
    print_table(rows, copy_gbs)
    return rows


def smoke_triton() -> list[Row]:
    """The GPU loop on one tiny shape with the Triton kernel under the interpreter,
    once per path (single pass, split-KV), so the GPU code path cannot rot either."""
    shape = Shape("triton interp b2 ctx24", (1, 1), (24, 24), 4, 2, 32, 8, torch.float32)
    try:
        from pagefleet.kernels.triton_attention import paged_attention_triton
    except ImportError as exc:
        return [Row(shape, "-", note=f"triton unavailable: {exc}")]
    rows = []
    for splits in (1, 2):
        attention = functools.partial(paged_attention_triton, num_splits=splits)
        for row in measure([shape], torch.device("cpu"), attention, time_cpu, 1):
            row.note = f"num_splits={splits}; interpreter, time meaningless"
            rows.append(row)
    return rows


def print_table(rows: list[Row], copy_gbs: float) -> None:
    header = f"{'shape':26s} {'check':5s} {'ms':>9s} {'GB/s':>8s} {'%copy':>6s} {'sdpa ms':>9s} {'paged/sdpa':>10s}  note"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        if r.ms is None:
            print(
                f"{r.shape.name:26s} {r.check:5s} {'':>9s} {'':>8s} {'':>6s} {'':>9s} {'':>10s}  {r.note}"
            )
            continue
        gbs = r.shape.bytes_read() / (r.ms * 1e-3) / 1e9
        peer = f"{r.peer_ms:9.3f}" if r.peer_ms is not None else f"{'-':>9s}"
        ratio = f"{r.ms / r.peer_ms:10.2f}" if r.peer_ms else f"{'-':>10s}"
        print(
            f"{r.shape.name:26s} {r.check:5s} {r.ms:9.3f} {gbs:8.1f} {100 * gbs / copy_gbs:5.0f}% "
            f"{peer} {ratio}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny CPU sizes, seconds")
    mode.add_argument("--cpu", action="store_true", help="CPU reference path vs contiguous SDPA")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.smoke:
        # Must be set before the Triton kernels are decorated (first import).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.smoke or args.cpu or not torch.cuda.is_available():
        rows = run_cpu(args)
    else:
        rows = run_gpu(args)
    return 1 if any(r.check == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
