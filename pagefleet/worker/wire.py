"""The typed messages of the busiest boundary: one request into a worker, deltas out.

The ingress tokenizes once and sends a `WorkerRequest` (token ids only,
plus validated sampling params); the worker streams `TokenDelta`s back. Both are frozen dataclasses that Ray
pickles, so no string-keyed dict crosses the boundary and a field rename is
a type error, not a KeyError at run time. A migration by KV transfer adds a
`KVHandoff` to the source's last delta, which the ingress passes on in the
target's `WorkerRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVHandoff:
    """The KV blocks a worker handed a request off with (migration by transfer).

    `blocks` is a Ray ObjectRef (owned by the source worker) of the blocks'
    bytes (`kv_migration.to_bytes`): `len(block_hashes)` blocks of
    `block_shape` (`[layers, 2, block_size, kv_heads, head_dim]`) in `dtype`,
    `blocks[i]` registered under the chained prefix hash `block_hashes[i]`
    (salted by the tenant and the adapter, so only its requests can hit them).
    """

    block_hashes: tuple[bytes, ...]
    blocks: Any
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole host tensor: `[n, *block_shape]`."""
        return (len(self.block_hashes), *self.block_shape)


def origin_of(request_id: str) -> str:
    """The ingress replica that sent a request, from its id at the workers ("" for none):
    `<key>@<replica>`, or `<key>@<replica>#<completion>` for a completion resumed on its
    own after a failover (replica ids hold neither "@" nor "#"; keys may)."""
    _, at, tail = request_id.rpartition("@")
    return tail.partition("#")[0] if at else ""


@dataclass(frozen=True)
class WorkerRequest:
    """One generation request as a worker receives it.

    `request_id` is unique at the worker (the ingress tags it with its
    replica id); `salt` is the tenant's prefix-cache salt; `adapter` the name of
    the worker's LoRA adapter to generate with (None: the base model). `kv`: the blocks
    of this request another worker handed it off with; the worker imports
    them before it admits the request (or, if they cannot be fetched,
    recomputes them). `num_resumed_tokens`: how many tokens at the end of
    `prompt` an earlier attempt streamed (a resumed request), which the
    sampler's penalties count as output.
    """

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    salt: str | None = None
    kv: KVHandoff | None = None
    adapter: str | None = None
    num_resumed_tokens: int = 0


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since its previous delta; the last has `finish_reason`.

    `error` is set (and nothing else matters) when the request alone failed:
    `error_code` "invalid_argument" when the engine refused it as the client's
    fault (e.g. a token id outside the vocabulary), "internal" when its logits
    were not finite. The stream ends there, and the worker is not failed.
    `logprobs` (with `SamplingParams.logprobs`): one
    `(token_id, logprob, ((id, logprob), ...))` per token of `token_ids`.
    `index` names the completion (of the request's `SamplingParams.n`) the delta
    belongs to; each completion's last delta has its own `finish_reason`.
    `migrated_to` (a worker id) ends the stream without a finish: the worker
    handed the request off on the scheduler's order (its blocks are free
    already), and the ingress resumes it there, with `kv` when the order
    said to transfer the request's KV blocks (else, or without blocks to
    move, the target recomputes them).
    """

    token_ids: tuple[int, ...] = ()
    text: str = ""
    index: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: str = "invalid_argument"
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] | None = None
    migrated_to: str | None = None
    kv: KVHandoff | None = None

    @classmethod
    def from_output(cls, out: Any) -> TokenDelta:
        """The part of an engine `RequestOutput` the ingress needs."""
        return cls(
            token_ids=tuple(out.new_token_ids),
            text=out.new_text,
            index=out.index,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
            cached_tokens=int(out.num_cached_tokens),
            logprobs=None
            if out.new_logprobs is None
            else tuple((t.token_id, t.logprob, tuple(t.top)) for t in out.new_logprobs),
        )
