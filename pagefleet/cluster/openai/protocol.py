"""OpenAI request bodies as pydantic models (as vLLM keeps them), validated into one typed request.

`CompletionRequest` and `ChatCompletionRequest` check each field's type
strictly (no bool posing as a number, no string posing as a number) and the
shapes OpenAI allows (a prompt as text, token ids or a batch of one; chat
content as a string or text parts). Fields this server does not implement are
refused unless they carry their neutral value; unknown fields are ignored, as
OpenAI clients send some. Every refusal is INVALID_ARGUMENT naming the field
(`parse_request`), never pydantic's own wording.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagefleet.cluster.api import sampling_params
from pagefleet.cluster.errors import InvalidArgument
from pagefleet.worker.chat import ChatTemplateError
from pagefleet.worker.chat import chat_prompt as worker_chat_prompt
from pagefleet.worker.sampling_params import SamplingParams

# OpenAI's documented default; pass temperature 0 for greedy decoding.
DEFAULT_TEMPERATURE = 1.0

# Fields this server does not implement: a request setting one to anything but
# its neutral value is refused, rather than silently answered without it.
_UNSUPPORTED = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v is None,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, Mapping) and v.get("type") == "text"),
}

# What a field must be, for the message of a value of the wrong type.
_EXPECTED = {
    "model": "a string",
    "n": "an integer",
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "temperature": "a number >= 0",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 0 (0 or -1 disables it)",
    "seed": "an integer",
    "ignore_eos": "a boolean",
    "stream": "a boolean",
    "priority": "an integer",
    "top_logprobs": "an integer",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Body(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = ()
    stop_token_ids: Any = ()
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: Any = Field(default_factory=dict)
    # vLLM's extension: larger is admitted first and preempted last.
    priority: int | None = None

    chat: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ValueError("request body must be a JSON object")
        for name, neutral in _UNSUPPORTED.items():
            if name in data and not neutral(data[name]):
                raise ValueError(f"{name} is not supported by this server (got {data[name]!r})")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(f"n must be 1 (got {n}): this server returns one choice per request")
        return n

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return tuple(stop)
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids: Any) -> tuple[int, ...]:
        ids = ids or []
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        return tuple(ids)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, options: Any) -> Mapping[str, Any]:
        options = options or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"stream_options must be an object, got {options!r}")
        return options

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def params(self) -> SamplingParams:
        """The request's SamplingParams (values checked by SamplingParams, naming the limit)."""
        return sampling_params(
            logprobs=self._logprobs(),
            max_tokens=self._max_tokens(),
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=self.top_p,
            # -1 is how vLLM spells "off"; SamplingParams uses 0.
            top_k=None if self.top_k == -1 else self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Body):
    """A `/v1/completions` body."""

    prompt: Any
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, raw: Any) -> str | list[int]:
        """A string, a list of token ids, or a batch of exactly one of those."""
        if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
            if len(raw) > 1:
                raise ValueError(
                    f"batched prompts are not supported (got {len(raw)} prompts); send one per request"
                )
            raw = raw[0]
        if isinstance(raw, str):
            if not raw:
                raise ValueError("prompt is empty")
            return raw
        if isinstance(raw, list) and all(_is_int(t) for t in raw):
            if not raw:
                raise ValueError("prompt is empty")
            return [int(t) for t in raw]
        raise ValueError("prompt must be a string or a list of token ids")

    def _logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Body):
    """A `/v1/chat/completions` body."""

    messages: Any = Field(default=None, validate_default=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    chat: ClassVar[bool] = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, raw: Any) -> list[dict[str, str]]:
        """Role/content strings; content parts must be text."""
        if not isinstance(raw, list) or not raw:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        out = []
        for i, msg in enumerate(raw):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string role")
            content = msg.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            elif not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
            out.append({"role": msg["role"], "content": content})
        return out

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def _logprobs(self) -> int | None:
        # Chat asks with `logprobs: true` and `top_logprobs: k` alternatives.
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed `/v1/completions` or `/v1/chat/completions` body."""

    chat: bool
    model: str
    # Completions: the prompt (text or token ids). Chat: the messages.
    prompt: str | list[int] | list[dict[str, str]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int = 0


def parse_request(body: Any, *, chat: bool) -> OpenAIRequest:
    """Validate a completions (or chat) body; raises InvalidArgument naming the field."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        req: _Body = model.model_validate(body)
    except ValidationError as exc:
        raise InvalidArgument(_message(exc, chat=chat)) from None
    prompt = req.messages if isinstance(req, ChatCompletionRequest) else req.prompt  # type: ignore[attr-defined]
    return OpenAIRequest(
        chat=chat,
        model=req.model or "",
        prompt=prompt,
        params=req.params(),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options.get("include_usage")),
        priority=req.priority or 0,
    )


def _message(exc: ValidationError, *, chat: bool) -> str:
    """The first error, in this server's words: the field and what it must be."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    if error["type"] == "missing":
        return f"{name} is required"
    if error["type"] == "model_type":  # not a JSON object at all
        return "request body must be a JSON object"
    what = _EXPECTED.get(name)
    if name == "logprobs":
        what = "a boolean" if chat else "an integer (alternatives per token)"
    return f"{name} must be {what or 'valid'}, got {error['input']!r}"


def chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str | list[int]:
    """The prompt of a chat (the model's chat template; see `pagefleet.worker.chat`)."""
    try:
        return worker_chat_prompt(messages, tokenizer)
    except ChatTemplateError as exc:
        raise InvalidArgument(str(exc)) from exc


__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "OpenAIRequest",
    "chat_prompt",
    "parse_request",
]
