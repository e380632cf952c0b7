"""Run a Llama, Qwen2 or Mistral checkpoint over the paged KV cache, one engine step at a time.

The model is pagefleet's own (`pagefleet.worker.llama`: transformers' operations,
without transformers). A step packs every sequence's new tokens into one row of
`total_tokens` ids with per-token positions, runs the decoder with the step's
`PagedAttentionMetadata`, and applies the LM head only to each sequence's last
token.

A model whose attention the paged path cannot reproduce is refused at load
with `UnsupportedModelError`, never served wrongly: see `check_supported`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from pagefleet.kernels.cpu_decode import decode_kernel
from pagefleet.kernels.dispatch import choose_backend
from pagefleet.worker.cpu_linear import accelerate_cpu_layers, gemm_backend
from pagefleet.worker.cuda_graph import DecodeGraphs
from pagefleet.worker.kv_cache import KVCache, ModelShape, parse_dtype
from pagefleet.worker.llama import PagedAttentionMetadata, WeightsError, load_model
from pagefleet.worker.lora import LoRAManager
from pagefleet.worker.model_config import ModelConfig, read_model_config
from pagefleet.worker.model_files import (
    ModelFileError,
    check_weights,
    load_tokenizer,
    resolve_model_path,
)
from pagefleet.worker.step_inputs import StepBatch, StepInputs, StepTensors

# Architectures whose attention is plain causal (optionally windowed) softmax attention
# over RoPE'd q/k, which is exactly what paged_attention computes.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
# RoPE variants whose frequencies depend on the longest position in the batch: packing
# several sequences into one row would change one sequence's result through another.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class UnsupportedModelError(ValueError):
    """The model cannot run on the paged attention path; the message says why."""


def check_supported(config: Any) -> tuple[int | None, ...]:
    """Accept or refuse an HF config; return each layer's sliding window (None = full).

    Raises UnsupportedModelError with the reason for: an architecture outside
    `SUPPORTED_ARCHITECTURES`, a RoPE whose frequencies depend on the batch,
    a layer type other than full or sliding attention, a non-positive window,
    and a Mistral config with per-layer types (transformers' Mistral ignores them).
    """
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    known = sorted(SUPPORTED_ARCHITECTURES)
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        named = f" ({', '.join(architectures)})" if architectures else ""
        raise UnsupportedModelError(
            f"model_type {model_type!r}{named} is not supported on the paged attention path; "
            f"supported: {known}"
        )
    if not architectures:
        # Older configs omit `architectures`; AutoModelForCausalLM then goes by model_type.
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        if model_type not in by_type:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported on the paged attention path; "
                f"supported: {known}"
            )
        architectures = [by_type[model_type]]
    for arch in architectures:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch} is not supported on the paged attention path; "
                f"supported: {known}"
            )
        if SUPPORTED_ARCHITECTURES[arch] != model_type:
            raise UnsupportedModelError(
                f"architecture {arch} with model_type {model_type!r} is inconsistent; "
                f"expected model_type {SUPPORTED_ARCHITECTURES[arch]!r}"
            )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type in _BATCH_DEPENDENT_ROPE:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} scales frequencies by the longest sequence in the batch, "
            f"which packing would change; supported rope types exclude {_BATCH_DEPENDENT_ROPE}"
        )
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and len(set(layer_types)) > 1:
            raise UnsupportedModelError(
                "a Mistral config with mixed layer_types (alternating sliding and full "
                "attention) is not supported: transformers' Mistral applies one window to "
                "every layer"
            )
        return (_checked_window(window),) * num_layers
    # qwen2: transformers passes config.sliding_window to the layers typed "sliding_attention".
    windows: list[int | None] = []
    for i, layer_type in enumerate(config.layer_types):
        if layer_type == "full_attention":
            windows.append(None)
        elif layer_type == "sliding_attention":
            windows.append(_checked_window(window))
        else:
            raise UnsupportedModelError(
                f"layer {i} has attention type {layer_type!r}; supported: full_attention, "
                f"sliding_attention"
            )
    return tuple(windows)


def _checked_window(window: Any) -> int | None:
    if window is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(
            f"sliding_window must be a positive int or None, got {window!r}"
        )
    return window


class ModelRunner:
    """Loads a checkpoint (`pagefleet.worker.llama`) and runs engine steps on a bound `KVCache`.

    `kv_cache_dtype` is the dtype the KV cache stores: "auto" (the model
    `dtype`) or a narrower one (e.g. "float16" under a float32 model).
    `lora_adapters` (name -> PEFT adapter directory) wraps the projections
    they target once, at load (`self.lora`, a `LoRAManager`; None without
    adapters, and then nothing is wrapped).
    A float32 model on the CPU then runs on fused linear layers packed for the CPU's
    GEMM (`cpu_linear.accelerate_cpu_layers`; `self.cpu_gemm` names it, None where
    the plain layers run).

    `max_num_seqs`, `max_num_batched_tokens` and `max_model_len` (None: the
    model's `max_position_embeddings`) are the engine's limits: they size the
    step input buffers (`step_inputs.StepInputs`) and, on CUDA, the decode
    buckets. On CUDA a decode-only step is padded to its bucket and replayed
    from a CUDA graph (`cuda_graph.DecodeGraphs`), unless `enforce_eager`;
    on the CPU nothing is padded or captured, whatever `enforce_eager` says.
    """

    def __init__(
        self,
        model: str | Path = "tiny",
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        kv_cache_dtype: str | torch.dtype = "auto",
        lora_adapters: Mapping[str, str | Path] | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.dtype = parse_dtype(dtype)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype} not supported; use one of {_DTYPES}")
        self.kv_dtype = self.dtype if kv_cache_dtype == "auto" else parse_dtype(kv_cache_dtype)
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_dtype} not supported; use one of {_DTYPES}")
        self.device = torch.device(device)
        self.model_path = resolve_model_path(model)
        # Check the config before loading any weights: a refusal should be cheap.
        try:
            self.config: ModelConfig = read_model_config(self.model_path)
        except (ValueError, KeyError, TypeError) as exc:
            raise UnsupportedModelError(
                f"cannot read {self.model_path}/config.json: {exc}"
            ) from exc
        self.sliding_windows = check_supported(self.config)
        check_weights(self.model_path)
        if self.device.type == "cpu":
            # Build (or load) the C decode kernel now rather than in the first request's step.
            decode_kernel(self.dtype, self.kv_dtype)
        try:
            self.model = load_model(self.config, self.dtype, self.device)
        except WeightsError as exc:
            raise ModelFileError(str(exc)) from exc
        self.lora: LoRAManager | None = None
        if lora_adapters:
            self.lora = LoRAManager(self.model, lora_adapters, max_loras, max_lora_rank)
        # After LoRA: the projections it wraps stay unfused (see cpu_linear).
        self.cpu_gemm = gemm_backend(self.device, self.dtype)
        if self.cpu_gemm is not None:
            accelerate_cpu_layers(self.model, self.cpu_gemm)
        # None when the directory ships no tokenizer: the model is then served from token ids.
        self.tokenizer: Any | None = load_tokenizer(self.model_path)
        self.kv_cache: KVCache | None = None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.enforce_eager = enforce_eager
        self._out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        # Made at the first step, when the bound cache's block size gives the table width.
        self._inputs: StepInputs | None = None
        self._decode: DecodeGraphs | None = None

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the model's vocabulary, may exceed the tokenizer's)."""
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        sources = (
            generation_eos_token_id(self.model_path),
            self.config.eos_token_id,
            getattr(self.tokenizer, "eos_token_id", None),
        )
        for source in sources:
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        return ids

    @property
    def model_shape(self) -> ModelShape:
        """Per-token KV shape of this model in the KV cache dtype."""
        return ModelShape.from_hf_config(self.config, dtype=self.kv_dtype)

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    def bind_kv_cache(self, kv: KVCache) -> None:
        """Use `kv` for every later step; its shape, dtype and device must match the model."""
        if kv.shape != self.model_shape:
            raise ValueError(
                f"KV cache shape {kv.shape} does not match the model's {self.model_shape}"
            )
        if (kv.device.type, kv.device.index or 0) != (self.device.type, self.device.index or 0):
            raise ValueError(f"KV cache is on {kv.device}, the model on {self.device}")
        self.kv_cache = kv

    @property
    def num_cuda_graphs(self) -> int:
        """Decode buckets captured as CUDA graphs so far (always 0 on the CPU)."""
        return 0 if self._decode is None else len(self._decode.graphs)

    # no_grad, not inference_mode: the engine's sampler may edit the logits in place.
    @torch.no_grad()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; return logits `[num_seqs, vocab]` of each sequence's last new token.

        float32 for float32/float16/bfloat16 models, float64 for float64 models
        (the frozen eval compares argmax in float64). On CUDA nothing here waits
        for the device: the inputs travel through pinned buffers with
        non-blocking copies, attention gets its launch sizes from host-side
        hints, and the returned logits are still being computed; the caller's
        read of the sampled ids is the step's one host sync. (Capturing a
        bucket's graph, once per bucket, synchronizes the device.)
        """
        if self.kv_cache is None:
            raise RuntimeError("bind_kv_cache() must be called before execute()")
        batch.validate()
        if batch.num_seqs == 0:
            return torch.empty((0, self.vocab_size), dtype=self._out_dtype, device=self.device)
        if self.device.type == "cuda" and batch.num_tokens == batch.num_seqs:
            graphs = self._decode_graphs(self.kv_cache)
            bucket = graphs.bucket(batch)
            if bucket is not None:
                return graphs.run(batch, bucket)
        tensors = self._step_inputs(self.kv_cache).load(batch)
        max_query_len = max(b - a for a, b in pairwise(batch.query_start_loc))
        with self._lora_batch(batch):
            return self.forward(tensors, max_query_len, max(batch.context_lens))

    def forward(self, tensors: StepTensors, max_query_len: int, max_context_len: int) -> torch.Tensor:
        """The model over one step's device tensors (`StepInputs.load`): logits of each
        sequence's last token. `max_query_len`/`max_context_len` are host-side bounds
        (attention's launch sizes); a bound above the step's real maximum is allowed."""
        assert self.kv_cache is not None
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=tensors.slot_mapping,
            block_tables=tensors.block_tables,
            query_start_loc=tensors.query_start_loc,
            context_lens=tensors.context_lens,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            sliding_windows=self.sliding_windows,
        )
        hidden = self.model.model(tensors.input_ids, tensors.positions, metadata)
        logits = self.model.lm_head(hidden.index_select(0, tensors.last_rows))
        return logits.to(self._out_dtype)

    def _step_inputs(self, kv: KVCache) -> StepInputs:
        if self._inputs is None:
            width = -(-self.max_model_len // kv.block_size)
            self._inputs = StepInputs(
                self.device, self.max_num_batched_tokens, self.max_num_seqs, width
            )
        return self._inputs

    def _decode_graphs(self, kv: KVCache) -> DecodeGraphs:
        if self._decode is None or self._decode.kv_cache is not kv:
            # Graphs need the Triton kernels (float64 and a forced torch or CPU path run
            # the padded steps eagerly).
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            capture = not self.enforce_eager and choose_backend(probe) == "triton"
            self._decode = DecodeGraphs(
                self.forward, kv, self.max_num_seqs, self.max_model_len, capture
            )
        return self._decode

    def _lora_batch(self, batch: StepBatch) -> AbstractContextManager[None]:
        """Each packed token's LoRA slot, set on the wrapped projections for the forward."""
        if self.lora is None or batch.lora_slots is None:
            return nullcontext()
        token_slots = [
            slot
            for slot, (a, b) in zip(batch.lora_slots, pairwise(batch.query_start_loc), strict=True)
            for _ in range(b - a)
        ]
        return self.lora.batch(token_slots, self.device)

    def profile_peak_bytes(self, num_tokens: int, block_size: int = 16) -> int:
        """Activation bytes of one forward over `num_tokens` packed tokens (excl. weights and KV).

        On CUDA this runs a dummy prefill at that budget (sequences no longer than
        `max_position_embeddings`) on a scratch KV cache and reads
        `torch.cuda.max_memory_allocated` above the baseline. Elsewhere it returns
        `estimate_activation_bytes`, since CPU memory has no peak counter.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
        if self.device.type != "cuda":
            return self.estimate_activation_bytes(num_tokens)
        lens = _split(num_tokens, self.max_position_embeddings)
        blocks_per_seq = [math.ceil(n / block_size) for n in lens]
        scratch = KVCache(self.model_shape, sum(blocks_per_seq), block_size, self.device)
        tables: list[list[int]] = []
        next_block = 0
        for count in blocks_per_seq:
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        batch = StepBatch(
            input_ids=[0] * num_tokens,
            positions=[p for n in lens for p in range(n)],
            slot_mapping=[
                t[p // block_size] * block_size + p % block_size
                for t, n in zip(tables, lens, strict=True)
                for p in range(n)
            ],
            query_start_loc=[0, *_cumsum(lens)],
            context_lens=lens,
            block_tables=tables,
        )
        bound = self.kv_cache
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        try:
            self.kv_cache = scratch
            self.execute(batch)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - baseline
        finally:
            self.kv_cache = bound
            del scratch
            torch.cuda.empty_cache()
        return int(peak)

    def estimate_activation_bytes(self, num_tokens: int) -> int:
        """A closed-form upper estimate of one forward's activation bytes.

        Per token, the widest point of a decoder layer holds about four copies of
        the hidden state, q/k/v plus their rotated copies and the attention
        output, and four MLP-wide tensors (gate, up, activation, product).
        """
        cfg = self.config
        shape = self.model_shape
        q_width = cfg.num_attention_heads * shape.head_dim
        kv_width = shape.num_kv_heads * shape.head_dim
        per_token = (
            4 * cfg.hidden_size + 3 * q_width + 4 * kv_width + 4 * cfg.intermediate_size
        )
        return num_tokens * per_token * self.dtype.itemsize


def _split(total: int, max_len: int) -> list[int]:
    full, rest = divmod(total, max_len)
    return [max_len] * full + ([rest] if rest else [])


def _cumsum(values: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out


def generation_eos_token_id(path: Path) -> Any:
    """`eos_token_id` of the checkpoint's `generation_config.json` (None without one)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text("utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
