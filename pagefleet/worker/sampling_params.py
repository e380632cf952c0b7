"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagefleet.worker.structured_output import StructuredOutput

# Below this temperature sampling is greedy: dividing logits by a smaller number
# overflows float32 (1e-39 or 1e-300 would turn every logit into inf), and the
# distribution is argmax to within float32 rounding long before (vLLM uses the same).
GREEDY_TEMPERATURE_EPS = 1e-5
# Bounds on the per-request stop strings: every decoded token is matched against
# each of them, so an unbounded list (or a megabyte string) slows the whole batch.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Seeds are 64-bit (signed or unsigned, as clients send them); they are derived
# into torch's generator range, so a wider one would only cost time.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# Most alternatives a request may ask log-probabilities for (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
# OpenAI's bounds: presence/frequency penalties in [-2, 2], logit biases in [-100, 100],
# at most 300 biased tokens.
MAX_ABS_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completion(s) of one request.

    `temperature` below `GREEDY_TEMPERATURE_EPS` (1e-5), 0 included, is greedy (argmax). `top_k == 0` and `top_p == 1.0`
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

    Before temperature, `logit_bias` ((token_id, bias) pairs, or a dict)
    adds each bias to its token's logit; `repetition_penalty` divides the
    positive logits (multiplies the negative ones) of every token of the
    prompt or the output so far, as HF's RepetitionPenaltyLogitsProcessor;
    `frequency_penalty` subtracts, per token, the penalty times its count in
    the output so far and `presence_penalty` the penalty once if it occurs
    there (OpenAI's definitions). After temperature, `min_p` drops the tokens
    whose probability is below `min_p` times the most likely one's. The
    neutral values (no bias, 1.0, 0.0, 0.0, 0.0) leave the logits as they are.

    `structured` (a `StructuredOutput`: a JSON schema, any JSON object, a
    regex or a choice list) restricts each step's tokens to those its grammar
    allows; a completion that ends by itself then matches it (finish_reason
    "stop"). Every completion of `n` follows it on its own.
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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # NaN fails too
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be a 64-bit integer in [-2**63, 2**64 - 1], got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got {longest}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}"
            )
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
        self._check_penalties()
        self._check_logit_bias()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(
                f"structured must be a StructuredOutput or None, got {type(self.structured).__name__}"
            )

    def _check_penalties(self) -> None:
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        rp = self.repetition_penalty
        if not (_is_number(rp) and 0.0 < rp <= MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}], got {rp!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise ValueError(
                    f"{name} must be a number in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], "
                    f"got {value!r}"
                )

    def _check_logit_bias(self) -> None:
        raw: object = self.logit_bias
        pairs = list(raw.items()) if isinstance(raw, dict) else list(raw)  # type: ignore[call-overload]
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}"
            )
        out = []
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
            token, bias = pair
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
            if not (_is_number(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {bias!r} for token {token}"
                )
            out.append((token, float(bias)))
        object.__setattr__(self, "logit_bias", tuple(sorted(out)))

    @property
    def penalized(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
