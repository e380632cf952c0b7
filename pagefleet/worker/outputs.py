"""What the engine hands back: per-step deltas, finished completions, and the error for a
request it refuses (torch-free: a process that only relays requests reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the engine refuses; the message names the limit that was broken."""


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and of the most likely alternatives.

    `top` holds `(token_id, logprob)` of the `SamplingParams.logprobs` most
    likely tokens, most likely first (it may include the sampled token).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One finished (or in-progress) completion of a request; `n > 1` gives several."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """Progress of one completion (`index`) of one request.

    `LLMEngine.step()` returns one of these per completion that progressed:
    `new_token_ids` / `new_text` are the delta of this step, `token_ids` /
    `text` everything generated so far. `finish_reason` is None while the
    completion runs, then "stop" (EOS, a stop token or a stop string),
    "length" (`max_tokens`), "abort", or "error" with `error` saying why (the
    request alone failed, e.g. its logits were not finite; the engine goes on).
    `num_cached_tokens` counts prompt tokens served from the prefix cache at admission.
    With `SamplingParams.logprobs` set, `new_logprobs` / `logprobs` hold one
    `TokenLogprob` per token of `new_token_ids` / `token_ids` (else None).

    `LLM.generate()` returns one per prompt: the fields describe completion 0
    and `outputs` holds all `n` completions, ordered by index.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        """True once this completion has a finish reason."""
        return self.finish_reason is not None
