"""pagefleet's decoder: Llama, Qwen2 and Mistral over the paged KV cache.

The three families are one architecture (pre-norm decoder layers of RoPE
attention with grouped KV heads and a gated MLP); they differ in biases
(Qwen2's q/k/v; Llama's optional `attention_bias` and `mlp_bias`) and in
sliding windows (Mistral: every layer; Qwen2: the layers typed so). Every
operation is transformers' own, in transformers' order and dtypes (RMSNorm in
float32, RoPE's angles in float32), so the logits equal those of
transformers' modules; the step is one packed row of tokens (`[tokens,
hidden]`), and each attention layer writes its K/V into the pool and attends
through the block tables (`pagefleet.kernels`).

Module and parameter names are transformers' (`model.layers.0.self_attn.q_proj`),
so a checkpoint's tensors and a PEFT adapter's module paths map one to one.
Nothing here imports transformers: a worker starts without it. Only a RoPE
other than the default, or an activation other than SiLU, GELU or ReLU, asks
transformers for its function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels import paged_attention, write_kv
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.model_config import ModelConfig

# Buffers some checkpoints carry that the model computes itself.
_COMPUTED_KEYS = ("rotary_emb.inv_freq",)

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class WeightsError(ValueError):
    """A checkpoint whose tensors do not fit the model its config describes."""


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything the attention layers need for one step, already on the device.

    `sliding_windows[l]` is the window of layer `l` (None = full attention), as
    the runner derived it from the config when it accepted the model.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_context_len: int
    sliding_windows: tuple[int | None, ...]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: PagedAttentionMetadata,
    layer_idx: int,
    scaling: float,
) -> torch.Tensor:
    """Write one layer's K/V (`[tokens, kv_heads, dim]`) into the pool at the step's slots and
    attend through the block tables; `[tokens, heads, dim]` out."""
    k_cache, v_cache = metadata.kv_cache.layer(layer_idx)
    write_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, metadata.slot_mapping)
    return attend_written(q, metadata, layer_idx, scaling)


def attend_written(
    q: torch.Tensor, metadata: PagedAttentionMetadata, layer_idx: int, scaling: float
) -> torch.Tensor:
    """Attend through the block tables of a layer whose K/V of this step are in the pool;
    `[tokens, heads, dim]` out."""
    k_cache, v_cache = metadata.kv_cache.layer(layer_idx)
    out: torch.Tensor = paged_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.context_lens,
        scale=scaling,
        sliding_window=metadata.sliding_windows[layer_idx],
        max_query_len=metadata.max_query_len,
        max_context_len=metadata.max_context_len,
    )
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers computes it (`x * cos + rotate_half(x) * sin`); `cos`/`sin`
    broadcast over the heads."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        out: torch.Tensor = self.weight * hidden.to(dtype)
        return out


class RotaryEmbedding(nn.Module):
    """cos/sin of each packed token's position, `[tokens, head_dim]` in the model's dtype."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of the config's RoPE, as transformers
    computes them; RoPE types other than the default come from transformers itself.

    The default RoPE's are made on the CPU even inside `torch.device("meta")`: a meta
    `arange` goes through torch's Python reference ops, whose first use imports
    torch._dynamo (over a CPU-second at every model build)."""
    if config.rope_type == "default":
        base = float(config.rope_parameters["rope_theta"])
        dim = config.head_dim
        positions = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
        inv_freq = 1.0 / (base ** (positions / dim))
        return inv_freq, 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(config.path)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](hf_config, None)
    return inv_freq, float(scaling)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' `ACT2FN[name]` (the common ones without importing transformers)."""
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    fn: Callable[[torch.Tensor], torch.Tensor] = ACT2FN[name]
    return fn


class Attention(nn.Module):
    """q/k/v projections, RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        hidden, d = config.hidden_size, config.head_dim
        q_width, kv_width = config.num_attention_heads * d, config.num_key_value_heads * d
        bias = config.attention_bias
        self.q_proj: nn.Module = nn.Linear(hidden, q_width, bias=bias)
        self.k_proj: nn.Module = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj: nn.Module = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj: nn.Module = nn.Linear(q_width, hidden, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, -1, self.head_dim)
        k = self.k_proj(hidden).view(tokens, -1, self.head_dim)
        v = self.v_proj(hidden).view(tokens, -1, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = attend(q, k, v, metadata, self.layer_idx, self.scaling)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, -1))
        return result


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj: nn.Module = nn.Linear(hidden, inner, bias=bias)
        self.up_proj: nn.Module = nn.Linear(hidden, inner, bias=bias)
        self.down_proj: nn.Module = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn: nn.Module = Attention(config, layer_idx)
        self.mlp: nn.Module = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, metadata)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm: the hidden state of every packed token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init (on the meta device a
        # normal_ goes through torch's Python reference ops: 1.5 s of imports).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the heads
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, metadata)
        out: torch.Tensor = self.norm(hidden)
        return out


class CausalLM(nn.Module):
    """The decoder plus its LM head (tied to the embedding when the config says so)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def base_model(self) -> DecoderModel:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model of `config` with the checkpoint's weights, in `dtype` on `device`, in eval mode.

    Built without initializing any weight (every parameter comes from the checkpoint);
    a tensor the model lacks, or a parameter the checkpoint lacks, is a WeightsError.
    """
    with torch.device("meta"):
        model = CausalLM(config)
    _materialize(model, dtype, device)
    if config.tie_word_embeddings:  # moving the parameters off the meta device untied them
        model.lm_head.weight = model.model.embed_tokens.weight
    # Computed, not loaded (and float32, as transformers keeps it whatever the model's dtype).
    model.model.rotary_emb.inv_freq = rope_frequencies(config)[0].to(device)
    params = dict(model.named_parameters())  # a tied head is the embedding's parameter
    skipped = ("lm_head.weight",) if config.tie_word_embeddings else ()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(config.path):
            if name.endswith(_COMPUTED_KEYS) or name in skipped:
                continue
            param = params.get(name)
            if param is None:
                raise WeightsError(f"{config.path}: tensor {name} is not part of the model")
            if tuple(param.shape) != tuple(tensor.shape):
                raise WeightsError(
                    f"{config.path}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the config makes it {tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightsError(f"{config.path}: the checkpoint lacks {', '.join(missing[:5])}")
    model.requires_grad_(False)
    return model.eval()


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to_empty(device=device).to(dtype)` without torch's Python reference ops: an
    `empty_like` of a meta tensor goes through them, and their first use imports sympy
    (over a CPU-second at every model build). Floating-point tensors take `dtype`."""
    for module in model.modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, old in tensors:
            kind = dtype if old.is_floating_point() else old.dtype
            new = torch.empty(old.shape, dtype=kind, device=device)
            setattr(module, name, nn.Parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new)


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory: `model.safetensors`, the shards its
    `model.safetensors.index.json` names, or `pytorch_model.bin`."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text("utf-8"))["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        yield from state.items()
        return
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118  (safe_open is no mapping)
                yield name, tensors.get_tensor(name)
