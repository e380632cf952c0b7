"""Multi-LoRA serving on one worker: PEFT adapters, device slots, and the wrapped projections.

- `load_adapter` reads a PEFT LoRA adapter (`adapter_config.json` +
  `adapter_model.safetensors`) into host memory and refuses what the worker
  cannot apply exactly (DoRA, biases, `modules_to_save`, per-module rank or
  alpha patterns, a rank above `max_lora_rank`, a module outside q/k/v/o and
  the MLP projections) with an error naming the adapter and the limit.
  Its identity, `name:<blake2b of the weights file>`, is the `adapter_id` of
  the prefix-cache hashes (`lora_files.adapter_identity` computes it without loading).
- `LoRASlotTable` is the per-worker table of `max_loras` device slots: an
  adapter is placed on first use, the least recently used one not in use is
  evicted when the table is full, and an adapter a running request uses is
  never evicted (the request that finds no slot waits).
- `LoRAManager` wraps the targeted `nn.Linear`s of an HF model once at load
  (`LoRALinear`; a model served without adapters is never wrapped), holds
  the stacked slot weights of each, copies an adapter's host weights into a
  slot when the table places it, and sets the step's per-token slots
  (`pagefleet.kernels.lora`) for the forward.
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from pagefleet.kernels.lora import LoRASegments, add_lora, lora_segments
from pagefleet.worker.lora_files import CONFIG_FILE, WEIGHTS_FILE, weights_hash

# Projections of the Llama/Qwen2/Mistral decoder layers a LoRA adapter may target.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY_PREFIX = "base_model.model."
# adapter_config.json fields that change the forward in ways the slots do not model:
# any truthy value is refused.
_UNSUPPORTED_FIELDS = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
)


class LoRAError(ValueError):
    """An adapter the worker refuses; the message names the adapter and the limit."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A PEFT LoRA adapter in host memory.

    `weights` maps a module path of the base model (`model.layers.0.self_attn.q_proj`)
    to its `(A [rank, in], B [out, rank])`; `scaling` is `alpha / rank`
    (`alpha / sqrt(rank)` with rsLoRA).
    """

    name: str
    path: Path
    rank: int
    scaling: float
    weights_hash: str
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def identity(self) -> str:
        """`name:hash`: what the prefix-cache hashes carry as the adapter id."""
        return f"{self.name}:{self.weights_hash}"


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check one PEFT LoRA adapter directory; raises LoRAError on anything unsupported."""
    directory = Path(path)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for required in (config_path, weights_path):
        if not required.is_file():
            raise LoRAError(f"LoRA adapter {name!r}: {required} not found (PEFT format needed)")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for option in _UNSUPPORTED_FIELDS:
        if config.get(option):
            raise LoRAError(
                f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported"
            )
    if config.get("bias", "none") != "none":
        raise LoRAError(
            f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    data = weights_path.read_bytes()
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types on a bad file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {weights_path}: {exc}") from exc
    return LoRAAdapter(
        name, directory, rank, float(scaling), weights_hash(data), _pair_weights(name, tensors, rank)
    )


def _pair_weights(
    name: str, tensors: Mapping[str, torch.Tensor], rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_KEY_PREFIX).rpartition(".lora_")
        if not key.startswith(_KEY_PREFIX) or kind not in ("A.weight", "B.weight"):
            raise LoRAError(
                f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix "
                f"(DoRA, embeddings and saved modules are not supported)"
            )
        if module.rpartition(".")[2] not in SUPPORTED_TARGETS:
            raise LoRAError(
                f"LoRA adapter {name!r}: module {module!r} is not a supported target; "
                f"supported: {', '.join(SUPPORTED_TARGETS)}"
            )
        halves.setdefault(module, {})[kind[0]] = tensor
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} needs 2-D lora_A and lora_B")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, but r is {rank}"
            )
        out[module] = (a, b)
    if not out:
        raise LoRAError(f"LoRA adapter {name!r}: the weights file holds no LoRA matrices")
    return out


@dataclass(frozen=True)
class LoRAUsage:
    """A worker's LoRA slots for its load report: `slots` is `max_loras` (0: the worker
    serves no adapters), `resident` the adapters in them (least recently used first),
    `loads` and `evictions` per adapter since start."""

    slots: int = 0
    resident: tuple[str, ...] = ()
    loads: Mapping[str, int] = field(default_factory=dict)
    evictions: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """`LoRASlotTable.place`: the adapter's slot, whether it must be loaded, whom it evicted."""

    slot: int
    load: bool
    evicted: str | None = None


class LoRASlotTable:
    """`max_loras` device slots, each holding one adapter by name, in LRU order."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(max_loras - 1, -1, -1))

    def slot_of(self, name: str) -> int | None:
        """The slot of a resident adapter, None when it is not resident."""
        return self._slots.get(name)

    @property
    def resident(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        return tuple(self._slots)

    def _victim(self, in_use: Collection[str]) -> str | None:
        return next((name for name in self._slots if name not in in_use), None)

    def can_place(self, name: str, in_use: Collection[str]) -> bool:
        """Whether `place` would succeed: resident, a free slot, or an adapter not in use."""
        return name in self._slots or bool(self._free) or self._victim(in_use) is not None

    def place(self, name: str, in_use: Collection[str]) -> Placement | None:
        """Make `name` resident and most recently used; None when every slot is in use.

        `in_use` names the adapters running requests use: they are never evicted.
        """
        if name in self._slots:
            self._slots.move_to_end(name)
            return Placement(self._slots[name], load=False)
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._victim(in_use)
            if evicted is None:
                return None
            slot = self._slots.pop(evicted)
        self._slots[name] = slot
        return Placement(slot, load=True, evicted=evicted)


class LoRALinear(nn.Module):
    """An `nn.Linear` plus the LoRA deltas of the step's slots (`add_lora`)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_scale: torch.Tensor

    def __init__(self, base: nn.Linear, manager: LoRAManager, num_slots: int, rank: int) -> None:
        super().__init__()
        self.base: nn.Linear = base
        self._manager = [manager]  # a list: not a submodule of the model
        w = base.weight
        kwargs: dict[str, Any] = {"dtype": w.dtype, "device": w.device}
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, rank, base.in_features, **kwargs), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, base.out_features, rank, **kwargs), persistent=False
        )
        self.register_buffer("lora_scale", torch.zeros(num_slots, **kwargs), persistent=False)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None, scale: float) -> None:
        """Hold `weights` (A, B) in `slot`, or nothing (zeros) when the adapter skips this module."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_scale[slot] = 0.0
        if weights is not None:
            a, b = weights
            self.lora_a[slot, : a.shape[0]].copy_(a)
            self.lora_b[slot, :, : b.shape[1]].copy_(b)
            self.lora_scale[slot] = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        segments = self._manager[0].segments
        if segments is None:
            return y
        flat_y = y.view(-1, y.shape[-1])
        add_lora(flat_y, x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b, self.lora_scale, segments)
        return y


class LoRAManager:
    """The adapters of one model runner: host copies, the slot table and the wrapped projections.

    Every configured adapter is read and checked here, at load, so a bad one
    fails the worker's start rather than a request. `loads_by_adapter` and
    `evictions_by_adapter` count, per adapter, its loads into a slot and its
    evictions from one since start.
    """

    def __init__(
        self,
        model: nn.Module,
        adapters: Mapping[str, str | Path],
        max_loras: int,
        max_lora_rank: int,
    ) -> None:
        self.adapters = {
            name: load_adapter(name, path, max_lora_rank) for name, path in adapters.items()
        }
        self.table = LoRASlotTable(max_loras)
        self.segments: LoRASegments | None = None
        self.loads_by_adapter: Counter[str] = Counter()
        self.evictions_by_adapter: Counter[str] = Counter()
        rank = max(a.rank for a in self.adapters.values())
        targets = {m for a in self.adapters.values() for m in a.weights}
        modules = dict(model.named_modules())
        self.modules: dict[str, LoRALinear] = {}
        for path in sorted(targets):
            base = _find_linear(modules, path)
            for adapter in self.adapters.values():
                if path in adapter.weights:
                    _check_shapes(adapter, path, base)
            wrapped = LoRALinear(base, self, max_loras, rank)
            parent_path, _, attr = path.rpartition(".")
            setattr(modules[parent_path] if parent_path else model, attr, wrapped)
            self.modules[path] = wrapped

    def identity(self, name: str) -> str:
        """The adapter's `name:hash` identity (KeyError for an unknown name)."""
        return self.adapters[name].identity

    def can_acquire(self, name: str, in_use: Collection[str]) -> bool:
        """Whether `acquire(name, in_use)` would succeed now."""
        return self.table.can_place(name, in_use)

    def acquire(self, name: str, in_use: Collection[str]) -> bool:
        """Make `name` resident (loading it into a slot, evicting the LRU adapter not in
        `in_use` if the table is full); False when every slot is in use."""
        placement = self.table.place(name, in_use)
        if placement is None:
            return False
        if placement.load:
            adapter = self.adapters[name]
            for path, module in self.modules.items():
                module.set_slot(placement.slot, adapter.weights.get(path), adapter.scaling)
            self.loads_by_adapter[name] += 1
            if placement.evicted is not None:
                self.evictions_by_adapter[placement.evicted] += 1
        return True

    @property
    def loads(self) -> int:
        """Adapter loads into a slot since start, all adapters."""
        return self.loads_by_adapter.total()

    @property
    def evictions(self) -> int:
        """Adapter evictions from a slot since start, all adapters."""
        return self.evictions_by_adapter.total()

    def usage(self) -> LoRAUsage:
        """The slots, who holds them, and the loads and evictions per adapter, now."""
        return LoRAUsage(
            self.table.max_loras,
            self.table.resident,
            dict(self.loads_by_adapter),
            dict(self.evictions_by_adapter),
        )

    def slot_of(self, name: str) -> int:
        """The slot of a resident adapter (the engine acquires before it schedules)."""
        slot = self.table.slot_of(name)
        if slot is None:
            raise RuntimeError(f"LoRA adapter {name!r} is not resident")
        return slot

    @contextmanager
    def batch(self, token_slots: list[int], device: torch.device) -> Iterator[None]:
        """The step's per-token slots (-1: base model) for the forward inside the block."""
        self.segments = lora_segments(token_slots, device)
        try:
            yield
        finally:
            self.segments = None


def _find_linear(modules: Mapping[str, nn.Module], path: str) -> nn.Linear:
    module = modules.get(path)
    if not isinstance(module, nn.Linear):
        raise LoRAError(f"LoRA target {path!r} is not a linear layer of this model")
    return module


def _check_shapes(adapter: LoRAAdapter, path: str, base: nn.Linear) -> None:
    a, b = adapter.weights[path]
    if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
        raise LoRAError(
            f"LoRA adapter {adapter.name!r}: module {path!r} maps {a.shape[1]} -> {b.shape[0]} "
            f"features, the model's {base.in_features} -> {base.out_features}"
        )
