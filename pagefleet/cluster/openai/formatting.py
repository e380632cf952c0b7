"""OpenAI response objects: completions, chat completions, their chunks, usage, logprobs, errors.

Pure functions of the ingress's `StreamDelta`s; the tokenizer renders
logprob tokens as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from pagefleet.cluster.api import ErrorCode, IngressError, StreamDelta
from pagefleet.cluster.errors import WIRE_STATUS


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    wire = WIRE_STATUS[code]
    return {
        "error": {"message": message, "type": wire.openai_type, "param": None, "code": wire.openai_code}
    }


def error_response(exc: IngressError) -> JSONResponse:
    return JSONResponse(error_body(exc.code, exc.message), status_code=WIRE_STATUS[exc.code].http)


def usage(delta: StreamDelta) -> dict[str, Any]:
    """OpenAI usage from the last delta of a request."""
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},
    }


@dataclass
class Choice:
    """One completion of a non-streamed answer, gathered from its deltas."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None

    def add(self, delta: StreamDelta) -> None:
        self.parts.append(delta.text)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' log-probabilities (what `best_of` ranks by)."""
        return sum(logprob for _, logprob, _ in self.logprobs or ())


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The `n` choices of highest cumulative log-probability, best first, numbered 0..n-1
    (vLLM's `best_of`); all of them, in order, when there are `n`."""
    if len(choices) > n:
        choices = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
        for index, choice in enumerate(choices):
            choice.index = index
    return choices


@dataclass(frozen=True)
class ResponseFormat:
    """Builds the response objects of one endpoint (text completion or chat)."""

    chat: bool
    request_id: str
    model: str
    created: int
    tokenizer: Any = None  # renders logprob tokens as text; None: no logprobs asked for
    with_logprobs: bool = True  # False: the worker's logprobs only rank (best_of), none shown

    def logprobs(self, entries: list[Any] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `[token_id, logprob, [[id, logprob], ...]]` entries."""
        if entries is None or not self.with_logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **self._token(token_id, logprob),
                        "top_logprobs": [self._token(i, lp) for i, lp in top],
                    }
                    for token_id, logprob, top in entries
                ],
                "refusal": None,
            }
        tokens = [self._text(token_id) for token_id, _, _ in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [{self._text(i): lp for i, lp in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return str(self.tokenizer.decode([token_id]))

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def final(self, choices: list[Choice], last: StreamDelta) -> dict[str, Any]:
        """The whole answer: its choices, and the usage of the request's last delta."""
        out = []
        for c in choices:
            text = "".join(c.parts)
            choice: dict[str, Any] = {"index": c.index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=self.logprobs(c.logprobs), finish_reason=c.finish_reason)
            out.append(choice)
        return {**self._head(chunk=False), "choices": out, "usage": usage(last)}

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        *,
        index: int = 0,
        first: bool = False,
        logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice.update(logprobs=self.logprobs(logprobs), finish_reason=finish_reason)
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self, last: StreamDelta) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage(last)}


__all__ = ["Choice", "ResponseFormat", "best", "error_body", "error_response", "usage"]
