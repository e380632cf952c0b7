"""Request and sequence state inside the engine.

A request owns `n` sequences (completions). Sequence 0 is created at
`add_request`; the others fork from it once its prompt is computed, sharing
every prompt block copy-on-write. The single counter `num_computed_tokens`
(tokens whose K/V are in the cache) drives prefill, chunked prefill, prefix
hits, decode and recompute alike: each step computes
`token_ids[num_computed_tokens:]`, capped by the token budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagefleet.worker.prefix_hash import extend_block_hashes
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.seeds import derive_seed, draw_seed

if TYPE_CHECKING:
    from pagefleet.worker.block_table import BlockTable
    from pagefleet.worker.detokenizer import IncrementalDetokenizer
    from pagefleet.worker.grammar import TokenMatcher
    from pagefleet.worker.outputs import TokenLogprob


class SequenceStatus(enum.Enum):
    """Where a sequence is: which queue holds it."""

    WAITING = "waiting"  # no blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds blocks in the pool
    SWAPPED = "swapped"  # its blocks live in the CPU swap space
    FINISHED = "finished"


@dataclass
class SwappedKV:
    """Blocks of a sequence parked in the CPU swap space."""

    handle: Any  # what KVCacheManager.swap_out returned
    num_blocks: int
    num_bytes: int


@dataclass
class Request:
    """One client request: a prompt, its sampling parameters and `n` sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    salt: str | None
    base_seed: int
    # The LoRA adapter (by name; None: the base model) and its `name:hash` identity,
    # which every prefix hash of the request carries.
    adapter: str | None = None
    adapter_id: str | None = None
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    forked: bool = False  # siblings 1..n-1 exist
    # Tokens at the end of the prompt that an earlier attempt generated (a request
    # resumed here after a failover or hand-off): penalties count them as output.
    num_resumed_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True once every completion has finished (siblings included)."""
        if self.params.n > 1 and not self.forked:
            # Only sequence 0 exists before the fork, and it can only end by abort.
            return bool(self.sequences) and self.sequences[0].finish_reason == "abort"
        return all(seq.finish_reason is not None for seq in self.sequences)


class Sequence:
    """One completion being generated: its tokens, cache progress and queue state."""

    def __init__(
        self,
        request: Request,
        index: int,
        token_ids: list[int],
        detokenizer: IncrementalDetokenizer | None,
    ) -> None:
        self.request = request
        self.index = index
        self.seq_id = f"{request.request_id}#{index}"
        self.token_ids = token_ids  # prompt followed by generated tokens
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.table: BlockTable | None = None
        self.status = SequenceStatus.WAITING
        self.admitted_seq = -1
        self.swapped: SwappedKV | None = None
        self.num_registered_blocks = 0  # leading full blocks whose hash is in the pool
        # Chained prefix hashes of the full blocks of token_ids, computed once each as
        # the sequence grows (its tokens never change, so they stay valid across
        # preemption); copied by a fork.
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.num_emitted_tokens = 0  # generated tokens already reported in a delta
        # One entry per generated token when the request asked for logprobs.
        self.logprobs: list[TokenLogprob] | None = (
            [] if request.params.logprobs is not None else None
        )
        # With structured output: the grammar state after this sequence's output tokens
        # (accepted once each as sampled; a recompute does not sample them again).
        self.matcher: TokenMatcher | None = None
        self.generator: torch.Generator | None = None
        self._seed = derive_seed(request.base_seed, index)
        if not request.params.greedy:
            # A private generator per sequence: its draws do not depend on batch mates.
            self.generator = torch.Generator().manual_seed(self._seed)

    def draw_generator(self) -> torch.Generator | None:
        """The generator of this sequence's next draw (None: greedy).

        A seeded request reseeds it from (its completion's seed, the output
        position) before each draw, so every draw depends on those alone: a
        request resumed after N tokens on another worker (its first N at the
        end of its prompt, `num_resumed_tokens`, and the completion's seed)
        draws exactly the tokens the undisturbed run would have. An unseeded
        one keeps drawing from one stream.
        """
        if self.generator is not None and self.request.params.seed is not None:
            position = self.request.num_resumed_tokens + self.num_output_tokens
            self.generator.manual_seed(draw_seed(self._seed, position))
        return self.generator

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def full_block_hashes(self, num_tokens: int, block_size: int) -> list[bytes]:
        """Prefix hashes of the full blocks among the first `num_tokens` tokens."""
        full = num_tokens // block_size
        if len(self.block_hashes) < full:
            self.block_hashes.extend(
                extend_block_hashes(
                    self.block_hashes,
                    self.token_ids,
                    block_size,
                    salt=self.request.salt,
                    adapter_id=self.request.adapter_id,
                )
            )
        return self.block_hashes[:full]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
