"""The CPU float32 fast path: fused q/k/v and gate/up, weights packed for the CPU's GEMM.

A float32 model on the CPU is rewritten at load (`pagefleet.worker.cpu_linear`),
for each packed GEMM this torch has (MKL's, oneDNN's); float64,
`PAGEFLEET_CPU_PACKED=off` and projections a LoRA adapter wraps keep the plain
modules. The fast path's logits are compared with the same model on the plain
modules and `F.linear`, in the same process, over the same paged steps. They
agree to float32 round-off, not bit for bit (MKL's packed GEMM sums like
`F.linear` from 16 rows up, oneDNN's in its own order). Greedy tokens must be
identical. Its layers in C (`pagefleet.kernels.cpu_layers`: RMSNorm, RoPE and the
K/V write, SiLU and the product) must give the logits of torch's operations bit for
bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_models import ARCHS, build_tiny_hf_model, prompt_ids
from lora_adapters import build_lora_adapter

from pagefleet import LLM, SamplingParams
from pagefleet.worker.cpu_linear import (
    MKL,
    ONEDNN,
    SWITCH_ENV,
    CPURMSNorm,
    FusedGateUpMLP,
    FusedQKVAttention,
    PackedLinear,
    available_backends,
    gemm_backend,
)
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.llama import Attention, RMSNorm
from pagefleet.worker.lora import LoRALinear
from pagefleet.worker.model_runner import ModelRunner, StepBatch

BACKENDS = available_backends()
pytestmark = pytest.mark.skipif(
    not BACKENDS, reason="torch has no packed GEMM here (MKL, oneDNN): the fast path does not apply"
)
CPU = torch.device("cpu")

BLOCK_SIZE = 8
PROMPT_LENS = (3, 9, 17, 30)
# float32 round-off over a 2-layer model: logits of magnitude ~10 agree to ~1e-5.
ATOL, RTOL = 1e-4, 1e-5
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _model(arch: str, tmp_path: Path, **overrides: object) -> Path:
    return build_tiny_hf_model(arch, tmp_path, dtype=torch.float32, **overrides)


def _arch_model(arch: str, tmp_path: Path) -> Path:
    """The tiny float32 model of `arch`: Qwen2 brings q/k/v biases, Mistral a sliding window
    shorter than the longest prompt."""
    overrides = {"sliding_window": 8} if arch == "mistral" else {}
    return _model(arch, tmp_path, **overrides)


def _runner(model_dir: Path, monkeypatch: pytest.MonkeyPatch, backend: str | None,
            **kwargs: object) -> ModelRunner:  # fmt: skip
    """A runner on `backend`'s packed GEMM, or on the plain modules (None)."""
    with monkeypatch.context() as env:
        env.setenv(SWITCH_ENV, backend or "off")
        runner = ModelRunner(model_dir, dtype="float32", **kwargs)  # type: ignore[arg-type]
    runner.bind_kv_cache(KVCache(runner.model_shape, 64, BLOCK_SIZE))
    return runner


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of one packed prefill step of every prompt, then one decode step of each."""
    tables, slots, next_block = [], [], 0
    for p in prompts:
        blocks = list(range(next_block, next_block + len(p) // BLOCK_SIZE + 1))
        next_block += len(blocks)
        tables.append(blocks)
        slots.append([blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(p) + 1)])
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    prefill = StepBatch(
        input_ids=[t for p in prompts for t in p],
        positions=[i for p in prompts for i in range(len(p))],
        slot_mapping=[s for p, row in zip(prompts, slots, strict=True) for s in row[: len(p)]],
        query_start_loc=starts,
        context_lens=[len(p) for p in prompts],
        block_tables=tables,
    )
    first = runner.execute(prefill)
    decode = StepBatch(
        input_ids=first.argmax(dim=-1).tolist(),
        positions=[len(p) for p in prompts],
        slot_mapping=[row[len(p)] for p, row in zip(prompts, slots, strict=True)],
        query_start_loc=list(range(len(prompts) + 1)),
        context_lens=[len(p) + 1 for p in prompts],
        block_tables=tables,
    )
    return [first, runner.execute(decode)]


def test_the_default_gemm_is_mkl_on_intel_and_onednn_elsewhere_and_the_switch_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    wanted = [MKL, ONEDNN] if intel else [ONEDNN, MKL]
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    default = next(b for b in wanted if b in BACKENDS)
    assert gemm_backend(CPU, torch.float32) == default
    monkeypatch.setenv(SWITCH_ENV, "auto")
    assert gemm_backend(CPU, torch.float32) == default
    for backend in BACKENDS:
        monkeypatch.setenv(SWITCH_ENV, backend.upper())
        assert gemm_backend(CPU, torch.float32) == backend
    monkeypatch.setenv(SWITCH_ENV, "off")
    assert gemm_backend(CPU, torch.float32) is None
    monkeypatch.delenv(SWITCH_ENV)
    assert gemm_backend(CPU, torch.float64) is None
    assert gemm_backend(torch.device("meta"), torch.float32) is None
    with pytest.raises(ValueError, match="must be 'mkl' or 'onednn', got 'blas'"):
        PackedLinear(torch.nn.Linear(4, 4), "blas")
    monkeypatch.setenv(SWITCH_ENV, "onedn")
    with pytest.raises(ValueError, match="PAGEFLEET_CPU_PACKED must be one of auto, off, mkl, onednn"):
        gemm_backend(CPU, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float32_cpu_model_runs_on_fused_packed_layers(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(_model("llama", tmp_path), monkeypatch, backend)
    assert runner.cpu_gemm == backend
    for layer in runner.model.model.layers:
        assert isinstance(layer.self_attn, FusedQKVAttention)
        assert isinstance(layer.mlp, FusedGateUpMLP)
    linears = [m for m in runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) and m.backend == backend for m in linears)
    assert isinstance(runner.model.get_output_embeddings(), PackedLinear)


def test_float64_and_the_switch_keep_the_plain_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    off = _runner(model_dir, monkeypatch, None)
    exact = ModelRunner(model_dir, dtype="float64")
    for runner in (off, exact):
        assert runner.cpu_gemm is None
        assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
        assert type(runner.model.model.layers[0].self_attn) is Attention


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_path_logits_equal_the_plain_modules_to_float32_round_off(
    arch: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _arch_model(arch, tmp_path)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    fast = _prefill_then_decode(_runner(model_dir, monkeypatch, backend), prompts)
    plain = _prefill_then_decode(_runner(model_dir, monkeypatch, None), prompts)
    for got, want in zip(fast, plain, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_c_layers_give_the_logits_of_torchs_operations_bit_for_bit(
    arch: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(_arch_model(arch, tmp_path), monkeypatch, backend)
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    layers = list(runner.model.model.layers)
    assert norms and all(type(m) is CPURMSNorm for m in norms)
    assert all(isinstance(layer.self_attn, FusedQKVAttention) for layer in layers)
    assert all(layer.self_attn.kernels is not None for layer in layers)
    assert all(layer.mlp.kernels is not None for layer in layers)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    in_c = _prefill_then_decode(runner, prompts)
    # The same weights and GEMMs on torch's operations: its RMSNorm, RoPE, K/V write, SiLU
    # and product.
    for layer in layers:
        layer.self_attn.kernels = layer.mlp.kernels = None
    for module in list(runner.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, CPURMSNorm):
                plain = RMSNorm(child.weight.shape[0], child.variance_epsilon)
                plain.weight = child.weight
                setattr(module, name, plain)
    in_torch = _prefill_then_decode(runner, prompts)
    for got, want in zip(in_c, in_torch, strict=True):
        assert torch.equal(got, want)


def test_fast_path_greedy_tokens_equal_the_plain_modules_through_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    outs = {}
    for backend in [None, *BACKENDS]:
        with monkeypatch.context() as env:
            env.setenv(SWITCH_ENV, backend or "off")
            llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64)
        assert llm.engine.runner.cpu_gemm == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for backend in BACKENDS:
        assert outs[backend] == outs[None], backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_wrapped_projections_stay_unfused_on_packed_bases(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    adapter = build_lora_adapter(model_dir, tmp_path / "attn", seed=1, rank=4,
                                 target_modules=("q_proj", "v_proj"))  # fmt: skip
    runner = _runner(model_dir, monkeypatch, backend, lora_adapters={"attn": adapter})
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        assert type(attn) is Attention  # q/v wrapped: not fused
        assert isinstance(attn.q_proj, LoRALinear) and isinstance(attn.q_proj.base, PackedLinear)
        assert isinstance(attn.k_proj, PackedLinear)
        assert isinstance(layer.mlp, FusedGateUpMLP)  # no adapter on the MLP


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 5, 15, 16, 40])
def test_packed_linear_matches_f_linear_on_any_leading_shape(rows: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(48, 80)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=gen))
        linear.bias.copy_(torch.randn(80, generator=gen))
    packed = PackedLinear(linear, backend)
    x = torch.randn(1, rows, 48, generator=gen)
    got = packed(x)
    assert got.shape == (1, rows, 80)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(ONEDNN not in BACKENDS, reason="torch has no oneDNN packed GEMM here")
def test_onednn_gives_each_row_the_same_output_whatever_the_batch_around_it() -> None:
    gen = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(576, 960, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=gen) * 0.05)
    packed = PackedLinear(linear, ONEDNN)
    x = torch.randn(64, 576, generator=gen)
    full = packed(x)
    for rows in (1, 5, 16, 33):
        assert torch.equal(packed(x[:rows]), full[:rows]), rows
