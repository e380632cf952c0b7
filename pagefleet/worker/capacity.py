"""KV capacity planning: how many tokens and sequences a memory budget holds.

The arithmetic behind `pagefleet plan`. One token costs
`layers x kv_heads x head_dim x 2 (K and V) x dtype bytes` whether or not the
cache is paged; paging only stops each sequence from reserving `max_model_len`
tokens up front, so the budget is spent on tokens that exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.worker.block_pool import is_valid_block_size
from pagefleet.worker.kv_cache import ModelShape
from pagefleet.worker.sizes import format_bytes


@dataclass(frozen=True)
class CapacityPlan:
    """KV capacity of `budget_bytes` for one model shape and a prompt/output length mix."""

    shape: ModelShape
    budget_bytes: int
    block_size: int = 16
    max_model_len: int = 2048
    prompt_len: int = 512
    output_len: int = 128

    def __post_init__(self) -> None:
        if not is_valid_block_size(self.block_size):
            raise ValueError(f"block size must be a power of two, got {self.block_size}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.prompt_len < 1 or self.output_len < 0:
            raise ValueError(
                f"need prompt_len >= 1 and output_len >= 0, got {self.prompt_len} and {self.output_len}"
            )
        if self.seq_len > self.max_model_len:
            raise ValueError(
                f"prompt_len + output_len = {self.seq_len} exceeds max_model_len {self.max_model_len}"
            )
        if self.budget_bytes < self.bytes_per_block:
            raise ValueError(
                f"budget of {self.budget_bytes} bytes holds no block: one block of {self.block_size} tokens "
                f"needs {self.bytes_per_block} bytes"
            )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers."""
        return self.shape.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block."""
        return self.shape.bytes_per_block(self.block_size)

    @property
    def num_blocks(self) -> int:
        """Whole blocks in the budget."""
        return self.budget_bytes // self.bytes_per_block

    @property
    def tokens_fit(self) -> int:
        """Token slots in those blocks."""
        return self.num_blocks * self.block_size

    @property
    def seq_len(self) -> int:
        """Tokens one sequence holds at its end: prompt plus output."""
        return self.prompt_len + self.output_len

    @property
    def blocks_per_seq(self) -> int:
        """Blocks a sequence holds at its end when paged."""
        return -(-self.seq_len // self.block_size)

    @property
    def paged_seqs(self) -> int:
        """Sequences that fit concurrently when each holds only its own blocks."""
        return self.num_blocks // self.blocks_per_seq

    @property
    def reserved_seqs(self) -> int:
        """Sequences that fit when each reserves `max_model_len` contiguous tokens."""
        return self.budget_bytes // (self.max_model_len * self.bytes_per_token)

    @property
    def full_context_seqs(self) -> int:
        """Sequences at a full `max_model_len` context that fit even when paged."""
        return self.num_blocks // -(-self.max_model_len // self.block_size)

    @property
    def paged_vs_reserved(self) -> float:
        """How many times more sequences paging fits (inf when reservation fits none)."""
        if self.reserved_seqs == 0:
            return float("inf")
        return self.paged_seqs / self.reserved_seqs

    def as_dict(self) -> dict[str, object]:
        """Every input and derived figure, for `--json` and tooling."""
        return {
            "num_layers": self.shape.num_layers,
            "num_kv_heads": self.shape.num_kv_heads,
            "head_dim": self.shape.head_dim,
            "dtype": str(self.shape.dtype).removeprefix("torch."),
            "budget_bytes": self.budget_bytes,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "tokens_fit": self.tokens_fit,
            "blocks_per_seq": self.blocks_per_seq,
            "paged_seqs": self.paged_seqs,
            "reserved_seqs": self.reserved_seqs,
            "full_context_seqs": self.full_context_seqs,
        }

    def report(self, model_name: str) -> str:
        """The human-readable plan `pagefleet plan` prints."""
        s = self.shape
        dtype = str(s.dtype).removeprefix("torch.")
        ratio = self.paged_vs_reserved
        ratio_text = "no sequence fits when reserving" if ratio == float("inf") else f"{ratio:.2f}x"
        full_ctx_bytes = self.max_model_len * self.bytes_per_token
        lines = [
            f"KV capacity plan for {model_name}: {s.num_layers} layers, {s.num_kv_heads} KV heads, "
            f"head_dim {s.head_dim}, {dtype}",
            "",
            f"  bytes per token     {self.bytes_per_token:>16,}   "
            f"({s.num_layers} layers x {s.num_kv_heads} kv_heads x {s.head_dim} head_dim "
            f"x 2 (K and V) x {s.dtype_bytes} bytes)",
            f"  bytes per block     {self.bytes_per_block:>16,}   (block size {self.block_size} tokens)",
            f"  budget              {self.budget_bytes:>16,}   ({format_bytes(self.budget_bytes)})",
            f"  blocks              {self.num_blocks:>16,}",
            f"  tokens that fit     {self.tokens_fit:>16,}",
            "",
            f"Concurrent sequences of {self.prompt_len} prompt + {self.output_len} output tokens "
            f"(max_model_len {self.max_model_len}):",
            f"  paged ({self.blocks_per_seq} blocks each)".ljust(40) + f"{self.paged_seqs:>12,}",
            "  reserving max_model_len each".ljust(40) + f"{self.reserved_seqs:>12,}",
            "  paged / reserved".ljust(40) + f"{ratio_text:>12}",
            "",
            "Paging removes the waste of reserving max_model_len per sequence; it adds no memory.",
            "Long contexts still cost tokens x layers x kv_heads x head_dim x 2 x bytes:",
            f"one {self.max_model_len}-token sequence holds {format_bytes(full_ctx_bytes)} of KV, "
            f"and at most {self.full_context_seqs:,} such sequences fit, paged or not.",
        ]
        return "\n".join(lines)
