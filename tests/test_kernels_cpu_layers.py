"""The C elementwise layers (`pagefleet.kernels.cpu_layers`) against torch's own operations.

Both must give torch's bits, not merely agree: RoPE computes torch's products and sum in
its order and rounds into a float16 cache as torch does, RMSNorm adds its squares in the
order of torch's CPU reduction. Each is checked
on odd widths (a scalar tail, torch's cascade levels), strided rows, and one and three
threads (a row's bits never depend on how the rows are shared out).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagefleet.kernels.cpu_layers import LayerKernels, fits_rows, layer_kernels
from pagefleet.kernels.reference import write_kv_reference
from pagefleet.worker.llama import RMSNorm, rotate


@pytest.fixture(scope="module")
def kernels() -> LayerKernels:
    built = layer_kernels()
    assert built is not None, "the C library did not build (is a C compiler installed?)"
    return built


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _trig(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]  # [rows, 1, head_dim], as the model has them


# 576: SmolLM2's hidden size; 100 and 4,100 a scalar tail; 140,000 all of torch's cascade
# levels (it carries every 16, 256 and 4,096 groups of 32 floats); 3 under one vector.
@pytest.mark.parametrize("width", [576, 960, 100, 4100, 140_000, 3])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_gives_torchs_bits(kernels: LayerKernels, threads: int, width: int, rows: int) -> None:
    if rows * width > 3_000_000:
        rows = 20  # 140,000 wide: enough rows to share out, not 168 MB
    gen = torch.Generator().manual_seed(width + rows)
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    wide = torch.randn(rows, width + 5, generator=gen) * 4
    x = wide[:, 2 : 2 + width]  # rows apart by more than their width
    got = kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.is_contiguous()
    # torch shares one row of 32,768 floats or more over its threads (its grain), which changes
    # its order; the kernel's order never changes: compare with torch on one thread there.
    torch.set_num_threads(1 if rows == 1 and width >= 32_768 else threads)
    assert torch.equal(got, norm(x))


# 1,536: SmolLM2's; 56 and 100 end in torch's scalar tail (libm's expf past the last 32).
@pytest.mark.parametrize("inner", [1536, 56, 100])
@pytest.mark.parametrize("rows", [1, 9, 200])
def test_silu_and_product_give_torchs_bits(kernels: LayerKernels, threads: int, inner: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(inner + rows)
    gate_up = torch.randn(rows, 2 * inner, generator=gen) * torch.tensor([4.0, 40.0]).repeat_interleave(inner)
    # exp's edges: over- and underflow, its cut-offs at -104 and 100, infinities (-inf: NaN).
    edges = torch.tensor([0.0, -0.0, 88.5, -88.5, 103.9, -103.9, 104.5, -104.5, 100.5,
                          float("inf"), float("-inf")])  # fmt: skip
    gate_up[0, : min(inner, edges.numel())] = edges[:inner]
    gate, up = gate_up.split(inner, dim=-1)
    want = torch.nn.functional.silu(gate)
    want.mul_(up)
    got = kernels.silu_mul(gate_up, inner)
    assert got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaNs' bits too
    with pytest.raises(ValueError, match=f"not twice {inner + 1}"):
        kernels.silu_mul(gate_up, inner + 1)


def _step(rows: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(qkv, cos, sin, k_cache, v_cache, slots) of one step: every third row's slot -1, the
    others scattered over a cache of random contents."""
    gen = torch.Generator().manual_seed(seed)
    heads = q_heads + 2 * kv_heads
    qkv = (torch.randn(rows, heads * head_dim, generator=gen) * 3).view(rows, heads, head_dim)
    cos, sin = _trig(torch.randint(0, 32_768, (rows,), generator=gen), head_dim)
    blocks = -(-rows // 4) + 3
    k_cache = torch.randn(blocks, 4, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, 4, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(blocks * 4, generator=gen)[:rows]
    slots[::3] = -1
    return qkv, cos, sin, k_cache, v_cache, slots


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 8), (3, 1, 6)])
@pytest.mark.parametrize("rows", [1, 5, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_the_kv_write_give_the_bits_of_rotate_and_write_kv(
    kernels: LayerKernels, threads: int, q_heads: int, kv_heads: int, head_dim: int, rows: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    qkv, cos, sin, k_cache, v_cache, slots = _step(rows, q_heads, kv_heads, head_dim, dtype, rows)
    q, k, v = qkv.split((q_heads, kv_heads, kv_heads), dim=-2)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(rotate(k, cos, sin), v, want_k, want_v, slots)
    before = qkv.clone()
    assert kernels.writes(k_cache, v_cache)
    got_q = kernels.rope_write(qkv, cos, sin, q_heads, k_cache, v_cache, slots)
    assert got_q.is_contiguous()
    assert torch.equal(got_q, rotate(q, cos, sin))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(qkv, before)  # the projection's rows are only read


def test_rope_write_refuses_a_slot_outside_the_cache_and_writes_nothing(kernels: LayerKernels) -> None:
    qkv, cos, sin, k_cache, v_cache, slots = _step(6, 2, 1, 8, torch.float32, 0)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for bad in (k_cache.shape[0] * 4, -2):
        slots[-1] = bad
        with pytest.raises(IndexError, match=f"outside the cache's {k_cache.shape[0] * 4} slots"):
            kernels.rope_write(qkv, cos, sin, 2, k_cache, v_cache, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(ValueError, match="do not split into 3 q heads"):
        kernels.rope_write(qkv, cos, sin, 3, k_cache, v_cache, slots)
    bf16 = k_cache.to(torch.bfloat16)
    assert not kernels.writes(bf16, bf16)  # torch's write there
    assert not kernels.writes(k_cache.transpose(0, 1), v_cache.transpose(0, 1))
    odd = torch.zeros(2, 4, 1, 7)
    assert not kernels.writes(odd, odd)  # an odd head_dim: torch's RoPE and write there


def test_fits_rows_takes_dense_float32_rows_of_any_row_stride() -> None:
    x = torch.zeros(6, 10)
    assert fits_rows(x) and fits_rows(x[:, 2:7]) and fits_rows(x[::2])
    assert fits_rows(torch.zeros(4, 1, 8)) and fits_rows(torch.zeros(4, 3, 8))
    assert not fits_rows(x.t())  # columns apart
    assert not fits_rows(x[:, ::2])
    assert fits_rows(torch.zeros(4, 3, 8)[:, :2])  # rows 24 apart, each 2 dense heads
    assert not fits_rows(torch.zeros(4, 3, 16)[:, :, :8])  # heads of a row not dense
    assert not fits_rows(x.double()) and not fits_rows(torch.zeros(6))
