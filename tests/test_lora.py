"""LoRA adapters without an engine: loading and refusals, the slot table, the SGMV kernel.

The Triton kernel runs on CUDA when present, else under the Triton
interpreter (float32, small sizes), against the torch path.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lora_adapters import build_lora_adapter

from pagefleet import LLM
from pagefleet.kernels.lora import add_lora_reference, lora_segments
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.lora import LoRAError, LoRASlotTable, load_adapter
from pagefleet.worker.lora_files import adapter_identity
from pagefleet.worker.tiny_model import ensure_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(ensure_tiny_model(), tmp_path_factory.mktemp("a") / "a", seed=3)


def edited(adapter_dir: Path, tmp_path: Path, **fields: object) -> Path:
    """A copy of the adapter with `fields` changed in its adapter_config.json."""
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    (out / "adapter_model.safetensors").write_bytes(
        (adapter_dir / "adapter_model.safetensors").read_bytes()
    )
    return out


# ------------------------------------------------------------------ loading


def test_an_adapter_loads_with_its_rank_scaling_modules_and_identity(adapter_dir: Path) -> None:
    adapter = load_adapter("a", adapter_dir, max_rank=16)
    assert adapter.rank == 8 and adapter.scaling == 16.0 / 8
    assert len(adapter.weights) == 4 * 7  # 4 layers x q/k/v/o/gate/up/down
    a, b = adapter.weights["model.layers.0.mlp.down_proj"]
    assert a.shape == (8, 352) and b.shape == (128, 8)
    assert adapter.identity == adapter_identity("a", adapter_dir)
    assert adapter.identity.startswith("a:")


def test_the_identity_changes_with_the_name_and_the_weights(
    adapter_dir: Path, tmp_path: Path
) -> None:
    other = build_lora_adapter(ensure_tiny_model(), tmp_path / "b", seed=4)
    assert adapter_identity("a", adapter_dir) != adapter_identity("b", adapter_dir)
    assert adapter_identity("a", adapter_dir) != adapter_identity("a", other)


def test_rslora_scales_by_the_square_root_of_the_rank(adapter_dir: Path, tmp_path: Path) -> None:
    adapter = load_adapter("r", edited(adapter_dir, tmp_path, use_rslora=True), max_rank=16)
    assert adapter.scaling == pytest.approx(16.0 / math.sqrt(8))


def test_a_rank_above_max_lora_rank_is_refused_naming_both(adapter_dir: Path) -> None:
    with pytest.raises(LoRAError, match=r"'a': rank 8 exceeds max_lora_rank 4"):
        load_adapter("a", adapter_dir, max_rank=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("bias", "all"),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 4}),
        ("alpha_pattern", {"q_proj": 4}),
        ("fan_in_fan_out", True),
    ],
)
def test_unsupported_adapter_configs_are_refused_naming_the_field(
    adapter_dir: Path, tmp_path: Path, field: str, value: object
) -> None:
    with pytest.raises(LoRAError, match=rf"adapter 'bad': {field}=.*not supported"):
        load_adapter("bad", edited(adapter_dir, tmp_path, **{field: value}), max_rank=16)


def test_a_dora_adapter_built_by_peft_is_refused(tmp_path: Path) -> None:
    dora = build_lora_adapter(ensure_tiny_model(), tmp_path / "dora", seed=5, use_dora=True)
    with pytest.raises(LoRAError, match="use_dora=True is not supported"):
        load_adapter("dora", dora, max_rank=16)


def test_an_adapter_of_the_embeddings_is_refused(tmp_path: Path) -> None:
    emb = build_lora_adapter(
        ensure_tiny_model(), tmp_path / "emb", seed=6, target_modules=["embed_tokens"]
    )
    with pytest.raises(LoRAError, match="not a LoRA A/B matrix"):
        load_adapter("emb", emb, max_rank=16)


def test_a_directory_without_peft_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match=r"'x': .*adapter_config.json not found"):
        load_adapter("x", tmp_path, max_rank=16)


def test_an_engine_with_a_bad_adapter_fails_at_start(adapter_dir: Path) -> None:
    with pytest.raises(LoRAError, match="exceeds max_lora_rank 4"):
        LLM("tiny", lora_adapters={"a": adapter_dir}, max_lora_rank=4)


# ------------------------------------------------------------------- config


def test_config_takes_a_mapping_and_stores_sorted_pairs() -> None:
    config = EngineConfig(lora_adapters={"b": "/x/b", "a": Path("/x/a")})
    assert config.lora_adapters == (("a", "/x/a"), ("b", "/x/b"))
    assert (config.max_loras, config.max_lora_rank) == (4, 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loras": 0}, "max_loras must be >= 1, got 0"),
        ({"max_lora_rank": 0}, "max_lora_rank must be >= 1, got 0"),
        ({"lora_adapters": (("a", "/x"), ("a", "/y"))}, "'a' is listed twice"),
        ({"lora_adapters": {"": "/x"}}, "non-empty string without spaces"),
        ({"lora_adapters": {"a b": "/x"}}, "non-empty string without spaces"),
        ({"lora_adapters": {"a": ""}}, "'a' needs a directory"),
    ],
)
def test_config_refuses_bad_lora_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------- slot table


def test_the_slot_table_fills_free_slots_then_evicts_the_least_recently_used() -> None:
    table = LoRASlotTable(2)
    assert table.place("a", set()) is not None
    assert table.place("b", set()) is not None
    table.place("a", set())  # a is now the most recently used
    placement = table.place("c", set())
    assert placement is not None and placement.load and placement.evicted == "b"
    assert table.resident == ("a", "c")
    assert table.slot_of("c") == placement.slot


def test_the_slot_table_never_evicts_an_adapter_in_use() -> None:
    table = LoRASlotTable(2)
    table.place("a", set())
    table.place("b", set())
    placement = table.place("c", {"a"})
    assert placement is not None and placement.evicted == "b"
    assert not table.can_place("d", {"a", "c"})
    assert table.place("d", {"a", "c"}) is None
    assert table.resident == ("a", "c")


def test_a_resident_adapter_is_placed_without_a_load() -> None:
    table = LoRASlotTable(1)
    first = table.place("a", set())
    again = table.place("a", {"a"})
    assert first is not None and first.load
    assert again is not None and not again.load and again.slot == first.slot


# ------------------------------------------------------------------- kernel


def random_case(
    seed: int, token_slots: list[int], n_in: int, n_out: int, slots: int, rank: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    t = len(token_slots)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    scale = torch.rand(slots, generator=gen).to(DEVICE) + 0.5
    scale[-1] = 0.0  # an adapter that does not target this projection
    return randn(t, n_out), randn(t, n_in), randn(slots, rank, n_in), randn(slots, n_out, rank), scale


def test_segments_group_tokens_by_slot_and_skip_the_base_model() -> None:
    segments = lora_segments([1, -1, 0, 1, -1, 0, 2], "cpu")
    assert segments is not None
    assert segments.slots == [0, 1, 2] and segments.lens == [2, 2, 1]
    assert segments.token_order.tolist() == [2, 5, 0, 3, 6]
    assert lora_segments([-1, -1], "cpu") is None


def test_the_torch_path_adds_each_tokens_own_delta_and_leaves_base_tokens() -> None:
    token_slots = [0, -1, 1, 0, 2, -1]
    y, x, a, b, scale = random_case(0, token_slots, 24, 40, 3, 4)
    segments = lora_segments(token_slots, DEVICE)
    assert segments is not None
    out = y.clone()
    add_lora_reference(out, x, a, b, scale, segments)
    for t, s in enumerate(token_slots):
        want = y[t] if s < 0 else y[t] + scale[s] * (b[s] @ (a[s] @ x[t]))
        torch.testing.assert_close(out[t], want)


@pytest.mark.parametrize(
    ("token_slots", "n_in", "n_out", "rank"),
    [
        ([0, -1, 1, 0, 2, -1, 1, 1], 24, 40, 4),  # mixed, a slot not targeting (2)
        ([1] * 37, 72, 20, 8),  # one adapter, more tokens than one tile
        ([-1, 0, -1, 0] * 9, 130, 100, 16),  # shapes off the tile sizes
    ],
)
def test_the_triton_kernel_equals_the_torch_path(
    token_slots: list[int], n_in: int, n_out: int, rank: int
) -> None:
    pytest.importorskip("triton")
    from pagefleet.kernels.triton_lora import add_lora_triton

    y, x, a, b, scale = random_case(1, token_slots, n_in, n_out, 3, rank)
    segments = lora_segments(token_slots, DEVICE)
    assert segments is not None
    want, got = y.clone(), y.clone()
    add_lora_reference(want, x, a, b, scale, segments)
    add_lora_triton(got, x, a, b, scale, segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(want, y)
