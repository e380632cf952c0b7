"""The elementwise-layers benchmark runs end to end (so the script cannot rot), and every
layer it times (and the sampler's greedy picks) gives torch's bits."""

from __future__ import annotations

from collections.abc import Callable


def test_cpu_layers_times_each_layer_and_each_gives_torchs_bits(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("cpu_layers.py", "--rows", "3", "40", "--rounds", "1")
    rows = [line for line in out.splitlines() if line.rstrip().endswith(("True", "False"))]
    names = {line[:32].strip() for line in rows}
    assert {"RMSNorm", "RoPE of q and k, K/V write", "SiLU and product",
            "greedy picks (logits rows)"} <= names  # fmt: skip
    assert len(rows) >= 8 and all(line.rstrip().endswith("True") for line in rows), out
