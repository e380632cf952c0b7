"""Prompts at the ingress: tokenized once, checked against the pool's limits first.

The ingress tokenizes with the same tokenizer files the workers load, so its
block hashes (routing) agree with theirs; for the same reason it reads each
LoRA adapter's identity (`name:<hash of its weights>`, which a request's
prefix hashes carry) from the adapter files the workers load. A text that cannot fit
max_model_len is refused before tokenizing; a long one is tokenized in a
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pagefleet.cluster.config import PoolConfig
from pagefleet.cluster.errors import InvalidArgument, Unavailable
from pagefleet.worker.lora_files import adapter_identity
from pagefleet.worker.sampling_params import SamplingParams

# Text prompts up to this many characters are tokenized inline (well under a
# millisecond); longer ones in a thread, off the event loop.
INLINE_TOKENIZE_CHARS = 4096
# A lower bound on characters per token for the prompt-length check (byte-fallback
# and <unk> tokens may stand for more characters than their own spelling).
MIN_CHARS_PER_TOKEN = 8
# Tokenizers report a huge model_max_length (transformers' 1e30) when the model's limit
# is unknown.
UNKNOWN_MODEL_LEN = 10**7
# Token ids travel as int32 on gRPC; no vocabulary comes near it. The engine checks
# the model's vocabulary; this bound keeps hashing safe first.
MAX_TOKEN_ID = 2**31


class Prompts:
    """Per-pool tokenizers and the prompt checks that need them."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._max_token_chars: dict[str, int] = {}
        self._adapter_ids: dict[tuple[str, str], str] = {}

    def tokenizer(self, pool: PoolConfig) -> Any:
        """The pool's tokenizer, loaded on first use (None: the model has none)."""
        if pool.name not in self._tokenizers:
            self._tokenizers[pool.name] = load_tokenizer(str(pool.engine.model))
        return self._tokenizers[pool.name]

    def adapter_id(self, pool: PoolConfig, name: str) -> str:
        """The identity of the pool's LoRA adapter `name`, read on first use; UNAVAILABLE
        when its weights cannot be read here."""
        key = (pool.name, name)
        if key not in self._adapter_ids:
            path = pool.engine.adapter_dirs[name]
            try:
                self._adapter_ids[key] = adapter_identity(name, path)
            except OSError as exc:
                raise Unavailable(f"LoRA adapter {name!r} of pool {pool.name!r}: {exc}") from exc
        return self._adapter_ids[key]

    async def token_ids(self, pool: PoolConfig, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, refusing a text too long to fit before tokenizing it
        (and ids outside [0, MAX_TOKEN_ID)).

        A long text is tokenized in a thread: on the event loop it would stall every
        other stream of this ingress (tokenizing a megabyte takes seconds).
        """
        if isinstance(prompt, str):
            check_prompt_text(prompt, self._max_prompt_chars(pool))
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(self._encode, pool, prompt)
        return self._encode(pool, prompt)

    def _max_prompt_chars(self, pool: PoolConfig) -> int | None:
        """No prompt longer than this fits: max_model_len tokens x the longest token's characters."""
        tokenizer = self.tokenizer(pool)
        limit = pool.engine.max_model_len or getattr(tokenizer, "model_max_length", None)
        if not isinstance(limit, int) or limit > UNKNOWN_MODEL_LEN:
            return None  # HF's placeholder for "no limit known": the message size bounds it
        if pool.name not in self._max_token_chars:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
            self._max_token_chars[pool.name] = max(longest, MIN_CHARS_PER_TOKEN)
        return limit * self._max_token_chars[pool.name]

    def _encode(self, pool: PoolConfig, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return check_token_ids(prompt)
        tokenizer = self.tokenizer(pool)
        if tokenizer is None:
            raise InvalidArgument(
                f"pool {pool.name!r} serves a model without a tokenizer: send prompt_token_ids"
            )
        return [int(t) for t in tokenizer.encode(prompt)]  # as LLMEngine does


def check_token_ids(prompt: Sequence[int]) -> list[int]:
    """The ids as ints; INVALID_ARGUMENT naming the first one outside [0, MAX_TOKEN_ID)."""
    ids = [int(t) for t in prompt]
    for pos, tok in enumerate(ids):
        if not 0 <= tok < MAX_TOKEN_ID:
            raise InvalidArgument(
                f"prompt token id {tok} at position {pos} is outside [0, {MAX_TOKEN_ID})"
            )
    return ids


def check_n(params: SamplingParams, max_n: int) -> None:
    """INVALID_ARGUMENT for more completions than `server.max_n` allows."""
    if params.n > max_n:
        raise InvalidArgument(
            f"n must be at most {max_n} (server.max_n; on /v1/completions best_of counts), "
            f"got {params.n}"
        )


def check_length(pool: PoolConfig, prompt_ids: list[int], params: SamplingParams) -> None:
    """INVALID_ARGUMENT for an empty prompt, or one that cannot fit with its max_tokens."""
    if not prompt_ids:
        raise InvalidArgument("prompt is empty")
    limit = pool.engine.max_model_len
    if limit is not None and len(prompt_ids) + params.max_tokens > limit:
        raise InvalidArgument(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds max_model_len {limit}",
        )


def check_prompt_text(prompt: str, max_chars: int | None) -> None:
    """INVALID_ARGUMENT for a text prompt that is not Unicode text or cannot fit max_model_len."""
    if max_chars is not None and len(prompt) > max_chars:
        raise InvalidArgument(
            f"prompt of {len(prompt)} characters cannot fit: at most {max_chars} characters "
            "(max_model_len x the longest token's characters)",
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from JSON "\ud800"
        raise InvalidArgument(
            f"prompt is not valid Unicode: {exc.reason} at character {exc.start}",
        ) from exc


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a pool's model, resolved as the workers do (None: it has none)."""
    from pagefleet.worker import model_files

    return model_files.load_tokenizer(model_files.resolve_model_path(model))
