"""OpenAI request bodies as pydantic models (as vLLM keeps them), validated into one typed request.

`CompletionRequest` and `ChatCompletionRequest` check each field's type
strictly (no bool posing as a number, no string posing as a number) and the
shapes OpenAI allows (a prompt as text, token ids or a batch of one; chat
content as a string or text parts). Fields this server does not implement are
refused unless they carry their neutral value, and so is any field it does not
know: nothing a client sends is silently ignored (`user`, which only labels
the caller, is the one field accepted without effect). Every refusal is
INVALID_ARGUMENT naming the field (`parse_request`), never pydantic's own wording.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagefleet.cluster.api import sampling_params, structured_output
from pagefleet.cluster.errors import InvalidArgument
from pagefleet.worker.chat import CHAT_ROLES, TEMPLATE_MESSAGE_KEYS, ChatTemplateError, ChatTool
from pagefleet.worker.chat import chat_prompt as worker_chat_prompt
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.structured_output import StructuredOutput

# OpenAI's documented default; pass temperature 0 for greedy decoding.
DEFAULT_TEMPERATURE = 1.0


# Fields this server does not implement: a request setting one to anything but
# its neutral value is refused, rather than silently answered without it.
_UNSUPPORTED = {
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v is None,
    "parallel_tool_calls": lambda v: v is None,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
}

# `best_of` candidates at most: each decodes in the worker's batch, all to their end.
MAX_BEST_OF = 8
# Chat `tools`: OpenAI's bound on functions, a bound on their JSON (they go into the
# prompt), and OpenAI's rule for a function name.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 64 * 1024
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}

# Accepted and without effect: OpenAI's label of the end user.
_INFORMATIONAL = {"user"}

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
    "best_of": "an integer",
    "min_p": "a number in [0, 1]",
    "repetition_penalty": "a number in (0, 2]",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "user": "a string",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Body(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore", strict=True)

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
    # vLLM's extensions (min_p, repetition_penalty) and OpenAI's penalties.
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Any = None
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (at most one of them; see `structured_of`).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None

    chat: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ValueError("request body must be a JSON object")
        for name, neutral in _UNSUPPORTED.items():
            if name in data and not neutral(data[name]):
                raise ValueError(f"{name} is not supported by this server (got {data[name]!r})")
        unknown = sorted(set(data) - set(cls.model_fields) - set(_UNSUPPORTED) - _INFORMATIONAL)
        if unknown:
            where = "/v1/chat/completions" if cls.chat else "/v1/completions"
            raise ValueError(
                f"{unknown[0]} is not supported by this server on {where}; "
                "see docs/api.md for the accepted fields"
            )
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: Any) -> dict[int, float]:
        """OpenAI's map of token ids (as JSON object keys: strings of digits) to biases."""
        if bias is None:
            return {}
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {bias!r}")
        out = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and key.isascii()):
                raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"logit_bias values must be numbers, got {value!r} for token {key}")
            out[int(key)] = float(value)
        return out

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int | None) -> int | None:
        # The upper bound is the server's (`server.max_n`), checked by the ingress.
        if n is not None and n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n}")
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
        for key, value in options.items():
            # vLLM's per-chunk usage, unless off.
            if key == "continuous_usage_stats" and value in (None, False):
                continue
            if key != "include_usage":
                raise ValueError(
                    f"stream_options.{key} is not supported by this server (got {value!r}); "
                    "stream_options takes include_usage"
                )
            if not isinstance(value, (bool, type(None))):
                raise ValueError(f"stream_options.include_usage must be a boolean, got {value!r}")
        return options

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _candidates(self) -> int | None:
        """Completions to generate: `n` (completions: `best_of`, of which `n` are returned)."""
        return self.n

    def params(self) -> SamplingParams:
        """The request's SamplingParams (values checked by SamplingParams, naming the limit)."""
        return sampling_params(
            n=self._candidates(),
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
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            structured=structured_of(self),
        )


class CompletionRequest(_Body):
    """A `/v1/completions` body."""

    prompt: Any
    logprobs: int | None = None
    best_of: int | None = None

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

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is None:
            return self
        n = self.n or 1
        if not n <= self.best_of <= MAX_BEST_OF:
            raise ValueError(f"best_of must be in [n, {MAX_BEST_OF}] (n = {n}), got {self.best_of}")
        if self.stream and self.best_of > n:
            raise ValueError("best_of cannot be used with stream: true (the best are known at the end)")
        return self

    def _logprobs(self) -> int | None:
        if self.logprobs is None and self._ranked():
            return 0  # the candidates are ranked by their tokens' log-probabilities
        return self.logprobs

    def _candidates(self) -> int | None:
        return self.best_of if self.best_of is not None else self.n

    def _ranked(self) -> bool:
        """Whether the answer is the best `n` of more candidates (`best_of` > `n`)."""
        return self.best_of is not None and self.best_of > (self.n or 1)


class ChatCompletionRequest(_Body):
    """A `/v1/chat/completions` body."""

    messages: Any = Field(default=None, validate_default=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = Field(default=None, validate_default=True)
    tool_choice: Any = None

    chat: ClassVar[bool] = True

    @field_validator("tools")
    @classmethod
    def _tools(cls, raw: Any) -> tuple[ChatTool, ...]:
        """OpenAI's `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`."""
        if raw is None:
            return ()
        if not isinstance(raw, list):
            raise ValueError(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, got {raw!r}")
        if len(raw) > MAX_TOOLS:
            raise ValueError(f"tools may list at most {MAX_TOOLS} functions, got {len(raw)}")
        size = len(json.dumps(raw, separators=(",", ":")))
        if size > MAX_TOOLS_BYTES:
            raise ValueError(f"tools are {size} bytes as JSON; at most {MAX_TOOLS_BYTES} are allowed")
        return tuple(_tool_of(i, tool) for i, tool in enumerate(raw))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any) -> str | None:
        if choice is None or choice in ("none", "auto"):
            return choice  # type: ignore[no-any-return]
        raise ValueError(
            f"tool_choice {choice!r} is not supported by this server: only \"none\" and \"auto\" "
            "(the output is not parsed into tool calls, so none can be required)"
        )

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, raw: Any) -> list[dict[str, str]]:
        """Role/content strings: a known role, content a string or text parts."""
        if not isinstance(raw, list) or not raw:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        return [_message_of(i, msg) for i, msg in enumerate(raw)]

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def template_tools(self) -> tuple[ChatTool, ...]:
        """The tools the chat template is given: none under `tool_choice: "none"`."""
        return () if self.tool_choice == "none" else self.tools  # type: ignore[no-any-return]

    def _max_tokens(self) -> int | None:
        # As OpenAI and vLLM: max_completion_tokens (the newer name) wins when both are set.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _logprobs(self) -> int | None:
        # Chat asks with `logprobs: true` and `top_logprobs: k` alternatives.
        return (self.top_logprobs or 0) if self.logprobs else None


# The keys of vLLM's `structured_outputs` this server implements; the others
# (grammar, structural_tag, whitespace_pattern, ...) are refused by name.
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                            "json_object": "json_object"}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def structured_of(body: _Body) -> StructuredOutput | None:
    """The body's structured output (None: free text); InvalidArgument naming the field.

    `response_format` `{"type": "json_schema", "json_schema": {"schema": ...}}`
    or `{"type": "json_object"}` (`{"type": "text"}`: none); vLLM's
    `structured_outputs` `{"json" | "regex" | "choice" | "json_object": ...}`;
    vLLM's older `guided_json`, `guided_regex`, `guided_choice`.
    """
    sources = [
        name
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice")
        if getattr(body, name) is not None
    ]  # fmt: skip
    if sources and sources[0] == "response_format" and _is_text_format(body.response_format):
        sources.pop(0)
    if len(sources) > 1:
        raise InvalidArgument(
            f"set at most one of {', '.join(sources)}: a request has one structured output"
        )
    if not sources:
        return None
    if sources[0] == "response_format":
        return _response_format(body.response_format)
    if sources[0] == "structured_outputs":
        return _structured_outputs(body.structured_outputs)
    if body.guided_json is not None:
        return structured_output(json_schema=_schema_field("guided_json", body.guided_json))
    if body.guided_regex is not None:
        if not isinstance(body.guided_regex, str):
            raise InvalidArgument(f"guided_regex must be a string, got {body.guided_regex!r}")
        return structured_output(regex=body.guided_regex)
    return structured_output(choice=_choice_field("guided_choice", body.guided_choice))


def _is_text_format(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") == "text" and set(value) == {"type"}


def _response_format(value: Any) -> StructuredOutput | None:
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "json_object" and set(value) == {"type"}:
        return structured_output(json_object=True)
    if kind == "json_schema":
        extra = sorted(set(value) - {"type", "json_schema"})
        if extra:
            raise InvalidArgument(f"response_format.{extra[0]} is not supported")
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidArgument(
                'response_format.json_schema must be an object {"name": ..., "schema": {...}}'
            )
        unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise InvalidArgument(f"response_format.json_schema.{unknown[0]} is not supported")
        if "schema" not in spec:
            raise InvalidArgument("response_format.json_schema.schema is required")
        if not isinstance(spec.get("name", ""), str):
            raise InvalidArgument("response_format.json_schema.name must be a string")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise InvalidArgument("response_format.json_schema.strict must be a boolean")
        return structured_output(
            json_schema=_schema_field("response_format.json_schema.schema", spec["schema"])
        )
    if kind in ("text", "json_object"):
        raise InvalidArgument(f'response_format {{"type": "{kind}"}} takes no other field')
    raise InvalidArgument(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        f'{{"type": "json_schema", "json_schema": {{...}}}}, got {value!r}'
    )


def _structured_outputs(value: Any) -> StructuredOutput | None:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"structured_outputs must be an object, got {value!r}")
    # vLLM's clients send the unused keys as null or false.
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise InvalidArgument(
            f"structured_outputs.{unknown[0]} is not supported by this server "
            f"(supported: {', '.join(_STRUCTURED_OUTPUTS_KEYS)})"
        )
    if len(given) != 1:
        raise InvalidArgument(
            "structured_outputs must set exactly one of "
            f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}, got {sorted(given) or 'none'}"
        )
    (key, raw), = given.items()
    if key == "json":
        return structured_output(json_schema=_schema_field("structured_outputs.json", raw))
    if key == "regex":
        if not isinstance(raw, str):
            raise InvalidArgument(f"structured_outputs.regex must be a string, got {raw!r}")
        return structured_output(regex=raw)
    if key == "choice":
        return structured_output(choice=_choice_field("structured_outputs.choice", raw))
    if raw is not True:
        raise InvalidArgument(f"structured_outputs.json_object must be true, got {raw!r}")
    return structured_output(json_object=True)


def _schema_field(name: str, raw: Any) -> Any:
    """A JSON schema as clients send it: an object, or its JSON text."""
    if not isinstance(raw, (Mapping, str)):
        raise InvalidArgument(f"{name} must be a JSON schema object, got {raw!r}")
    return dict(raw) if isinstance(raw, Mapping) else raw


def _choice_field(name: str, raw: Any) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(c, str) for c in raw):
        raise InvalidArgument(f"{name} must be a list of strings, got {raw!r}")
    if not raw:
        raise InvalidArgument(f"{name} is empty: at least one string is required")
    return raw


def _tool_of(i: int, tool: Any) -> ChatTool:
    """One entry of `tools`; ValueError naming what is wrong with it."""
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}, got {tool!r}')
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise ValueError(f"{where}.{extra[0]} is not supported")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function must be an object with a name")
    unknown = sorted(set(function) - _TOOL_FUNCTION_KEYS)
    if unknown:
        raise ValueError(f"{where}.function.{unknown[0]} is not supported")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    if not isinstance(function.get("strict", False), (bool, type(None))):
        raise ValueError(f"{where}.function.strict must be a boolean")
    return ChatTool(name, description, None if parameters is None else json.dumps(parameters))


_MESSAGE_KEYS = {"role", "content", "tool_calls", *TEMPLATE_MESSAGE_KEYS}


def _message_of(i: int, msg: Any) -> dict[str, str]:
    """One chat message as {role, content} (and its `name` and `tool_call_id`, which go
    to the chat template); ValueError naming what is wrong with it."""
    if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string role")
    role = msg["role"]
    if role not in CHAT_ROLES:
        raise ValueError(
            f"messages[{i}].role {role!r} is not supported; allowed roles: {', '.join(CHAT_ROLES)}"
        )
    unknown = sorted(set(msg) - _MESSAGE_KEYS)
    if unknown:
        raise ValueError(
            f"messages[{i}].{unknown[0]} is not supported by this server; a message takes "
            "role, content, name and tool_call_id"
        )
    if msg.get("tool_calls"):
        raise ValueError(f"messages[{i}].tool_calls: tool calls are not supported by this server")
    content = msg.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise ValueError(
                    f"messages[{i}].content[{j}]: content part type {kind!r} is not supported "
                    "(only 'text')"
                )
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise ValueError(
                    f"messages[{i}].content[{j}].{extra[0]} is not supported by this server; "
                    "a text part takes type and text"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        content = "".join(part["text"] for part in content)
    elif not isinstance(content, str):
        raise ValueError(
            f"messages[{i}].content must be a string or a list of text parts, got {content!r}"
        )
    message = {"role": role, "content": content}
    for key in TEMPLATE_MESSAGE_KEYS:
        value = msg.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"messages[{i}].{key} must be a string, got {value!r}")
        message[key] = value
    return message


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
    # Choices to return: `n`. With completions' `best_of` above it, `params.n` candidates
    # are generated and the `choices` of highest cumulative log-probability returned.
    choices: int = 1
    # Whether the client asked for logprobs (best_of asks the worker for them to rank).
    return_logprobs: bool = False
    # Chat: the tools its chat template is given.
    tools: tuple[ChatTool, ...] = ()


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
        choices=req.n or 1,
        return_logprobs=req.logprobs is not None and req.logprobs is not False,  # type: ignore[attr-defined]
        tools=req.template_tools() if isinstance(req, ChatCompletionRequest) else (),
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


def chat_prompt(
    messages: list[dict[str, str]], tokenizer: Any, tools: tuple[ChatTool, ...] = ()
) -> str | list[int]:
    """The prompt of a chat (the model's chat template, given `tools`; see
    `pagefleet.worker.chat`)."""
    try:
        return worker_chat_prompt(messages, tokenizer, tools)
    except ChatTemplateError as exc:
        raise InvalidArgument(str(exc)) from exc


__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "OpenAIRequest",
    "chat_prompt",
    "parse_request",
]
