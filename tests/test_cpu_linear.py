"""The CPU float32 fast path: fused q/k/v and gate/up, weights packed for MKL's GEMM.

A float32 model on the CPU is rewritten at load (`pagefleet.worker.cpu_linear`);
float64, `PAGEFLEET_CPU_PACKED=off` and projections a LoRA adapter wraps keep
the plain modules. The fast path's logits are compared with the same model on the
plain modules and `F.linear`, in the same process, over the same paged steps.
They agree to float32 round-off, not bit for bit: MKL's packed GEMM sums like
`F.linear` from 16 rows up (bit-identical on the machines measured), but for
fewer rows `F.linear` takes another MKL kernel, with another summation order.
Greedy tokens must be identical.
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
    SWITCH_ENV,
    FusedGateUpMLP,
    FusedQKVAttention,
    PackedLinear,
    cpu_fast_path_applies,
)
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.llama import Attention
from pagefleet.worker.lora import LoRALinear
from pagefleet.worker.model_runner import ModelRunner, StepBatch

pytestmark = pytest.mark.skipif(
    not cpu_fast_path_applies(torch.device("cpu"), torch.float32),
    reason="torch has no MKL packed GEMM here: the fast path does not apply",
)

BLOCK_SIZE = 8
PROMPT_LENS = (3, 9, 17, 30)
# float32 round-off over a 2-layer model: logits of magnitude ~10 agree to ~1e-5.
ATOL, RTOL = 1e-4, 1e-5
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _model(arch: str, tmp_path: Path, **overrides: object) -> Path:
    return build_tiny_hf_model(arch, tmp_path, dtype=torch.float32, **overrides)


def _runner(model_dir: Path, monkeypatch: pytest.MonkeyPatch, packed: bool,
            **kwargs: object) -> ModelRunner:  # fmt: skip
    with monkeypatch.context() as env:
        if not packed:
            env.setenv(SWITCH_ENV, "off")
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


def test_a_float32_cpu_model_runs_on_fused_packed_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(_model("llama", tmp_path), monkeypatch, packed=True)
    assert runner.fast_cpu_layers
    for layer in runner.model.model.layers:
        assert isinstance(layer.self_attn, FusedQKVAttention)
        assert isinstance(layer.mlp, FusedGateUpMLP)
    linears = [m for m in runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert isinstance(runner.model.get_output_embeddings(), PackedLinear)


def test_float64_and_the_switch_keep_the_plain_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    off = _runner(model_dir, monkeypatch, packed=False)
    exact = ModelRunner(model_dir, dtype="float64")
    for runner in (off, exact):
        assert not runner.fast_cpu_layers
        assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
        assert type(runner.model.model.layers[0].self_attn) is Attention


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_path_logits_equal_the_plain_modules_to_float32_round_off(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Qwen2 brings q/k/v biases; Mistral a sliding window shorter than the longest prompt.
    overrides = {"sliding_window": 8} if arch == "mistral" else {}
    model_dir = _model(arch, tmp_path, **overrides)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    fast = _prefill_then_decode(_runner(model_dir, monkeypatch, packed=True), prompts)
    plain = _prefill_then_decode(_runner(model_dir, monkeypatch, packed=False), prompts)
    for got, want in zip(fast, plain, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))


def test_fast_path_greedy_tokens_equal_the_plain_modules_through_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    outs = {}
    for packed in (True, False):
        with monkeypatch.context() as env:
            if not packed:
                env.setenv(SWITCH_ENV, "off")
            llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64)
        assert llm.engine.runner.fast_cpu_layers is packed
        outs[packed] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs[True] == outs[False]


def test_lora_wrapped_projections_stay_unfused_on_packed_bases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _model("llama", tmp_path)
    adapter = build_lora_adapter(model_dir, tmp_path / "attn", seed=1, rank=4,
                                 target_modules=("q_proj", "v_proj"))  # fmt: skip
    runner = _runner(model_dir, monkeypatch, packed=True, lora_adapters={"attn": adapter})
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        assert type(attn) is Attention  # q/v wrapped: not fused
        assert isinstance(attn.q_proj, LoRALinear) and isinstance(attn.q_proj.base, PackedLinear)
        assert isinstance(attn.k_proj, PackedLinear)
        assert isinstance(layer.mlp, FusedGateUpMLP)  # no adapter on the MLP


@pytest.mark.parametrize("rows", [1, 5, 15, 16, 40])
def test_packed_linear_matches_f_linear_on_any_leading_shape(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(48, 80)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=gen))
        linear.bias.copy_(torch.randn(80, generator=gen))
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 48, generator=gen)
    got = packed(x)
    assert got.shape == (1, rows, 80)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), atol=ATOL, rtol=RTOL)
