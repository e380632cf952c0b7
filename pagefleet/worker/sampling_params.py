"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

# Most alternatives a request may ask log-probabilities for (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completion(s) of one request.

    `temperature == 0` is greedy (argmax). `top_k == 0` and `top_p == 1.0`
    disable those filters. `seed` makes the request's random draws
    reproducible whatever else shares its batch; `n > 1` samples `n`
    completions that share the prompt's KV blocks (copy-on-write).
    Generation stops at `max_tokens`, at the model's EOS token unless
    `ignore_eos`, at any of `stop_token_ids` (the token is kept in
    `token_ids`), or when the text contains one of `stop` (the stop text is
    not part of the output text). `logprobs=k` returns, per generated token,
    its log-probability and those of the `k` most likely tokens (0: the
    sampled token's only), from the model's distribution before temperature
    and filtering; None returns none.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax."""
        return self.temperature == 0.0
