"""A checkpoint's `config.json`, read as transformers reads it, without transformers.

`ModelConfig` holds what `pagefleet.worker.llama` builds a model from, with
the defaults of transformers' `LlamaConfig`, `Qwen2Config` and
`MistralConfig` for whatever the file leaves out (tests compare every field
with `AutoConfig` on each family). Attribute names are transformers', so
`check_supported` and `ModelShape.from_hf_config` read either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Per family: transformers' defaults for the fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
}
# transformers' RotaryEmbeddingConfigMixin.default_theta
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and options (transformers' attribute names and defaults).

    `rope_parameters` is transformers' standardized dict (`rope_type`,
    `rope_theta`, and the type's own keys); `layer_types` is Qwen2's
    per-layer attention kind (None for Llama and Mistral); `attention_bias`
    covers q/k/v (Qwen2: always; Llama: `attention_bias`) and `o_bias` the
    output projection (Llama's `attention_bias` only).
    """

    path: Path
    model_type: str | None
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any]
    sliding_window: int | None
    layer_types: tuple[str, ...] | None
    attention_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_id: int | list[int] | None
    raw: dict[str, Any] = field(repr=False)

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))


def read_model_config(path: Path) -> ModelConfig:
    """The config of the checkpoint directory `path` (ValueError on a malformed file)."""
    raw = json.loads((path / "config.json").read_text("utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("config.json does not hold a JSON object")
    model_type = raw.get("model_type")
    values = {**_DEFAULTS.get(str(model_type), _DEFAULTS["llama"]), **raw}

    def get(name: str) -> Any:
        return values.get(name)

    heads = int(get("num_attention_heads"))
    kv_heads = get("num_key_value_heads")
    head_dim = get("head_dim") or int(get("hidden_size")) // heads
    num_layers = int(get("num_hidden_layers"))
    sliding_window = get("sliding_window")
    layer_types = get("layer_types")
    if model_type == "qwen2":
        if not get("use_sliding_window"):
            sliding_window = None
        if layer_types is None:
            layer_types = [
                "sliding_attention"
                if sliding_window is not None and i >= int(get("max_window_layers"))
                else "full_attention"
                for i in range(num_layers)
            ]
    attention_bias = model_type == "qwen2" or (model_type == "llama" and bool(get("attention_bias")))
    return ModelConfig(
        path=path,
        model_type=model_type,
        architectures=tuple(raw.get("architectures") or ()),
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(head_dim),
        hidden_act=str(get("hidden_act")),
        max_position_embeddings=int(get("max_position_embeddings")),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        rope_parameters=_rope_parameters(values),
        sliding_window=sliding_window,
        layer_types=tuple(layer_types) if layer_types is not None else None,
        attention_bias=attention_bias,
        o_bias=model_type == "llama" and bool(get("attention_bias")),
        mlp_bias=model_type == "llama" and bool(get("mlp_bias")),
        eos_token_id=get("eos_token_id"),
        raw=raw,
    )


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """transformers' standardized `rope_parameters` (`convert_rope_params_to_dict`): the
    dict from `rope_scaling` or `rope_parameters`, `type` read as `rope_type`, `rope_theta`
    from the top level when the dict lacks it, and for llama3/yarn/longrope the pretraining
    length as `original_max_position_embeddings`."""
    rope = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    rope.setdefault("rope_theta", values.get("rope_theta", DEFAULT_ROPE_THETA))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in values:
            rope["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    return rope
