"""The OpenAI-compatible HTTP front of an `Ingress`: completions, chat, models, health.

Like the gRPC servicer, this module only translates: JSON bodies to
`GenerationRequest`, ingress deltas to OpenAI response objects (or SSE
chunks), and `IngressError` codes to HTTP status codes with OpenAI-style
error JSON. Authentication, tenant pools, routing, admission, failover and
aborts are the ingress's, shared with gRPC.

Served by uvicorn on the ingress replica's own event loop (`start_http_server`),
so HTTP handlers, gRPC handlers and the Ray streaming calls share one loop.

A client that disconnects (mid-stream, or while waiting for a non-streamed
answer) cancels its request: the response watches the connection and, on
`http.disconnect`, cancels the task reading the ingress stream, whose
`finally` aborts the request on the worker (its blocks return to the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagefleet.cluster.api import (
    DEFAULT_MAX_TOKENS,
    ErrorCode,
    Front,
    GenerationRequest,
    IngressError,
    StreamDelta,
    api_key_from_metadata,
)
from pagefleet.cluster.config import ClusterConfig, ServerConfig, TenantConfig
from pagefleet.cluster.dashboard import dashboard_routes
from pagefleet.cluster.drain import Drain
from pagefleet.worker.chat import ChatTemplateError
from pagefleet.worker.chat import chat_prompt as worker_chat_prompt

logger = logging.getLogger(__name__)

# HTTP status and OpenAI error `type` per ingress error code.
_HTTP_ERRORS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorCode.PERMISSION_DENIED: (403, "permission_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.ALREADY_EXISTS: (409, "conflict_error"),
    # Queues full: 429 makes OpenAI clients back off and retry.
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}

# OpenAI's documented default; pass temperature 0 for greedy decoding.
DEFAULT_TEMPERATURE = 1.0

# Fields this server does not implement: a request setting one to anything but
# its neutral value is refused, rather than silently answered without it.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
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


def _invalid(message: str) -> IngressError:
    return IngressError(ErrorCode.INVALID_ARGUMENT, message)


# ----- request parsing (pure; no ingress needed) --------------------------------------


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed `/v1/completions` or `/v1/chat/completions` body."""

    chat: bool
    model: str
    # Completions: the prompt (text or token ids). Chat: the messages.
    prompt: str | list[int] | list[dict[str, str]]
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    # vLLM's extension: larger is admitted first and preempted last.
    priority: int = 0


def _typed(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """body[name] if it is of `kind` (never a bool posing as a number), None when absent/null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _invalid(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, kind):
        raise _invalid(f"{name} must be {what}, got {value!r}")
    return value


def _sampling(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    """SamplingParams keyword arguments from an OpenAI body (values checked by SamplingParams)."""
    for name, neutral in _UNSUPPORTED.items():
        if name in body and not neutral(body[name]):
            raise _invalid(f"{name} is not supported by this server (got {body[name]!r})")
    n = _typed(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise _invalid(f"n must be 1 (got {n}): this server returns one choice per request")
    max_tokens = _typed(body, "max_tokens", int, "an integer >= 1")
    if chat and max_tokens is None:
        max_tokens = _typed(body, "max_completion_tokens", int, "an integer >= 1")
    temperature = _typed(body, "temperature", (int, float), "a number >= 0")
    top_p = _typed(body, "top_p", (int, float), "a number in (0, 1]")
    top_k = _typed(body, "top_k", int, "an integer >= 0 (0 or -1 disables it)")
    seed = _typed(body, "seed", int, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _invalid(f"stop must be a string or a list of strings, got {stop!r}")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise _invalid(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}")
    ignore_eos = _typed(body, "ignore_eos", bool, "a boolean")
    return {
        "logprobs": _logprobs(body, chat=chat),
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        "top_p": 1.0 if top_p is None else float(top_p),
        # -1 is how vLLM spells "off"; SamplingParams uses 0.
        "top_k": 0 if top_k in (None, -1) else top_k,
        "seed": seed,
        "stop": stop,
        "stop_token_ids": tuple(stop_token_ids),
        "ignore_eos": bool(ignore_eos),
    }


def _logprobs(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """SamplingParams.logprobs: completions `logprobs: k`; chat `logprobs: true` + `top_logprobs: k`."""
    if not chat:
        return _typed(body, "logprobs", int, "an integer (alternatives per token)")  # type: ignore[no-any-return]
    wanted = _typed(body, "logprobs", bool, "a boolean")
    top = _typed(body, "top_logprobs", int, "an integer")
    if top is not None and not wanted:
        raise _invalid("top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _completion_prompt(raw: Any) -> str | list[int]:
    """A completions `prompt`: a string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise _invalid(
                f"batched prompts are not supported (got {len(raw)} prompts); send one per request"
            )
        raw = raw[0]
    if isinstance(raw, str):
        if not raw:
            raise _invalid("prompt is empty")
        return raw
    if isinstance(raw, list) and all(_is_int(t) for t in raw):
        if not raw:
            raise _invalid("prompt is empty")
        return [int(t) for t in raw]
    raise _invalid("prompt must be a string or a list of token ids")


def _messages(raw: Any) -> list[dict[str, str]]:
    """Chat `messages` as role/content strings; content parts must be text."""
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise _invalid(f"messages[{i}] must be an object with a string role")
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                raise _invalid(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif not isinstance(content, str):
            raise _invalid(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": msg["role"], "content": content})
    return out


def parse_request(body: Any, *, chat: bool) -> OpenAIRequest:
    """Validate a completions (or chat) body; raises IngressError(INVALID_ARGUMENT) with the reason."""
    if not isinstance(body, Mapping):
        raise _invalid("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid(f"model must be a string, got {model!r}")
    if chat:
        prompt: str | list[int] | list[dict[str, str]] = _messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise _invalid("prompt is required")
        prompt = _completion_prompt(body["prompt"])
    stream = _typed(body, "stream", bool, "a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise _invalid(f"stream_options must be an object, got {options!r}")
    priority = _typed(body, "priority", int, "an integer")
    return OpenAIRequest(
        chat=chat,
        model=model or "",
        prompt=prompt,
        sampling=_sampling(body, chat=chat),
        stream=bool(stream),
        include_usage=bool(options.get("include_usage")),
        priority=priority or 0,
    )


def chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str | list[int]:
    """The prompt of a chat (the model's chat template; see `pagefleet.worker.chat`)."""
    try:
        return worker_chat_prompt(messages, tokenizer)
    except ChatTemplateError as exc:
        raise _invalid(str(exc)) from exc


def resolve_pool(config: ClusterConfig, model: str, tenant: TenantConfig) -> str:
    """The pool a request's `model` names: a pool name, else a pool serving that model.

    No model: the tenant's pool. Unknown: NOT_FOUND (404).
    """
    if not model:
        return tenant.pool
    visible = config.visible_pools(tenant)
    if model in visible:
        return model
    serving = [p.name for p in config.pools if p.model == model and p.name in visible]
    if serving:
        return tenant.pool if tenant.pool in serving else serving[0]
    # The same answer for a pool that exists but is another tenant's: nothing to learn.
    raise IngressError(ErrorCode.NOT_FOUND, f"model {model!r} does not exist")


# ----- response objects -----------------------------------------------------------------


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    _, kind = _HTTP_ERRORS[code]
    wire_code = "model_not_found" if code is ErrorCode.NOT_FOUND else code.value
    return {"error": {"message": message, "type": kind, "param": None, "code": wire_code}}


def error_response(exc: IngressError) -> JSONResponse:
    status, _ = _HTTP_ERRORS[exc.code]
    return JSONResponse(error_body(exc.code, exc.message), status_code=status)


def usage(delta: StreamDelta) -> dict[str, Any]:
    """OpenAI usage from the last delta of a request."""
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},
    }


@dataclass(frozen=True)
class _Format:
    """Builds the response objects of one endpoint (text completion or chat)."""

    chat: bool
    request_id: str
    model: str
    created: int
    tokenizer: Any = None  # renders logprob tokens as text; None: no logprobs asked for

    def logprobs(self, entries: list[Any] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `[token_id, logprob, [[id, logprob], ...]]` entries."""
        if entries is None:
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

    def final(
        self, text: str, last: StreamDelta, logprobs: list[Any] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=self.logprobs(logprobs), finish_reason=last.finish_reason)
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(last)}

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        *,
        first: bool = False,
        logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
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


def _sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class GenerationResponse(Response):
    """Streams (or collects) one request's deltas; a client disconnect aborts the request.

    The status line is sent only after the first delta arrives, so errors the
    ingress raises before the first token (bad input, full queue, no worker)
    still get their HTTP status and error JSON, also for `stream: true`.
    """

    def __init__(
        self,
        deltas: AsyncGenerator[StreamDelta, None],
        fmt: _Format,
        *,
        stream: bool,
        include_usage: bool,
    ) -> None:
        super().__init__()
        self._deltas = deltas
        self._fmt = fmt
        self._stream = stream
        self._include_usage = include_usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._respond(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Disconnected: cancelling `work` raises CancelledError inside the
            # ingress stream, whose `finally` aborts the request on the worker.
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]

    async def _respond(self, send: Send) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._relay(tracked)
        except Exception as exc:
            # A bug, not a client error: still answer in OpenAI's error shape if we can.
            logger.exception("OpenAI HTTP request failed")
            if started:
                raise
            message = f"internal error: {type(exc).__name__}: {exc}"
            await _send_json(send, 500, error_body(ErrorCode.INTERNAL, message))

    async def _relay(self, send: Send) -> None:
        async with contextlib.aclosing(self._deltas) as deltas:
            try:
                first = await anext(deltas)
            except IngressError as exc:
                await _send_error(send, exc)
                return
            if self._stream:
                await self._send_stream(first, deltas, send)
            else:
                await self._send_whole(first, deltas, send)

    async def _send_whole(
        self, first: StreamDelta, deltas: AsyncIterator[StreamDelta], send: Send
    ) -> None:
        parts = [first.text]
        logprobs = None if first.logprobs is None else list(first.logprobs)
        last = first
        try:
            async for delta in deltas:
                parts.append(delta.text)
                if logprobs is not None:
                    logprobs.extend(delta.logprobs or ())
                last = delta
        except IngressError as exc:
            await _send_error(send, exc)
            return
        await _send_json(send, 200, self._fmt.final("".join(parts), last, logprobs))

    async def _send_stream(
        self, first: StreamDelta, deltas: AsyncIterator[StreamDelta], send: Send
    ) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if self._fmt.chat:  # OpenAI's first chat chunk carries the role
            await body(_sse(self._fmt.chunk("", None, first=True)))
        last = first
        try:
            delta: StreamDelta | None = first
            while delta is not None:
                last = delta
                # A token that ends inside a multi-byte character has no text yet.
                if delta.text or delta.finish_reason is not None or delta.logprobs:
                    chunk = self._fmt.chunk(
                        delta.text, delta.finish_reason, logprobs=delta.logprobs
                    )
                    await body(_sse(chunk))
                delta = await anext(deltas, None)
        except IngressError as exc:  # mid-stream (e.g. no worker left after a failover)
            await body(_sse(error_body(exc.code, exc.message)))
        else:
            if self._include_usage:
                await body(_sse(self._fmt.usage_chunk(last)))
        await body(_sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Send, status: int, body: Mapping[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_error(send: Send, exc: IngressError) -> None:
    await _send_json(send, _HTTP_ERRORS[exc.code][0], error_body(exc.code, exc.message))


# ----- reading the body -------------------------------------------------------------------


class _BodyError(Exception):
    """A body refused before parsing: too large (413) or too slow (408)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json(request: Request, limits: ServerConfig) -> Any:
    """The JSON body, read within `max_body_bytes` and `body_timeout_s`.

    Raises `_BodyError` (413, 408) or INVALID_ARGUMENT for a body that is not
    JSON, nests too deeply or holds a lone surrogate.
    """
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyError(413, f"request body of {declared} bytes exceeds server.max_body_bytes {limit}")

    async def read() -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _BodyError(413, f"request body exceeds server.max_body_bytes {limit}")
            parts.append(chunk)
        return b"".join(parts)

    try:
        raw = await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise _BodyError(
            408, f"request body not received within server.body_timeout_s {limits.body_timeout_s}s"
        ) from None
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """Decode a JSON body; INVALID_ARGUMENT naming what is wrong (never a 500)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _invalid("request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, invalid UTF-8, huge ints
        raise _invalid(f"request body is not valid JSON: {exc}") from exc
    _check_unicode(body)
    return body


def _check_unicode(body: Any) -> None:
    """INVALID_ARGUMENT when a string (key or value) holds a lone surrogate ("\\ud800"):
    JSON allows the escape, but it is no Unicode text a tokenizer can take."""
    stack = [body]
    while stack:  # iterative: the nesting may be as deep as json.loads allows
        item = stack.pop()
        if isinstance(item, str):
            texts: Any = (item,)
        elif isinstance(item, Mapping):
            texts = item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _invalid(
                    f"request body is not valid Unicode text: {exc.reason} in {text[:40]!r}"
                ) from None


# ----- the ASGI app -----------------------------------------------------------------------


def build_app(ingress: Front, drain: Drain | None = None) -> Starlette:
    """The Starlette app of the OpenAI endpoints over `ingress`."""
    api = _OpenAIApi(ingress, drain or Drain(ingress))
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        *dashboard_routes(ingress),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


class _OpenAIApi:
    """Endpoint handlers; each authenticates with the ingress's tenant logic (as gRPC does)."""

    def __init__(self, ingress: Front, drain: Drain) -> None:
        self._ingress = ingress
        self._drain = drain
        self._created = int(time.time())

    def _tenant(self, request: Request) -> TenantConfig:
        # Same header rules as gRPC metadata: `authorization: Bearer KEY` or `x-api-key`.
        return self._ingress.authenticate(api_key_from_metadata(request.headers.items()))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            tenant = self._tenant(request)
            body = await read_json(request, self._ingress.config.server)
            parsed = parse_request(body, chat=chat)
            config = self._ingress.config
            pool = self._ingress.tenant_pool(tenant, resolve_pool(config, parsed.model, tenant))
            if chat:
                assert isinstance(parsed.prompt, list)
                # A chat template may tokenize: off the event loop, like text prompts.
                prompt = await asyncio.to_thread(
                    chat_prompt, parsed.prompt, self._ingress.tokenizer(pool)  # type: ignore[arg-type]
                )
            else:
                prompt = parsed.prompt  # type: ignore[assignment]
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                req = GenerationRequest.create(
                    request_id=request_id,
                    prompt=prompt,
                    sampling=parsed.sampling,
                    priority=parsed.priority,
                    pool=pool,
                    salt=tenant.cache_salt(),
                    tenant=tenant.name,
                )
            except ValueError as exc:  # SamplingParams names the field and the limit
                raise _invalid(str(exc)) from exc
        except IngressError as exc:
            return error_response(exc)
        except _BodyError as exc:
            return JSONResponse(error_body(ErrorCode.INVALID_ARGUMENT, str(exc)), status_code=exc.status)
        tokenizer = (
            self._ingress.tokenizer(pool) if parsed.sampling["logprobs"] is not None else None
        )
        fmt = _Format(chat, request_id, parsed.model or pool, int(time.time()), tokenizer)
        return GenerationResponse(
            self._drain.generate(req), fmt, stream=parsed.stream, include_usage=parsed.include_usage
        )

    def _model_entry(self, pool_name: str) -> dict[str, Any]:
        pool = self._ingress.config.pool(pool_name)
        entry: dict[str, Any] = {
            "id": pool.name,
            "object": "model",
            "created": self._created,
            "owned_by": "pagefleet",
            "root": str(pool.model),
        }
        if pool.max_model_len is not None:  # else the model's own limit, unknown here
            entry["max_model_len"] = pool.max_model_len
        return entry

    async def models(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
        except IngressError as exc:
            return error_response(exc)
        data = [self._model_entry(name) for name in self._ingress.config.visible_pools(tenant)]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
            name = request.path_params["model"]
            if name not in self._ingress.config.visible_pools(tenant):
                raise IngressError(ErrorCode.NOT_FOUND, f"model {name!r} does not exist")
        except IngressError as exc:
            return error_response(exc)
        return JSONResponse(self._model_entry(name))

    async def health(self, request: Request) -> Response:
        """200 when every pool has a live worker, else 503 (also while draining). Live
        workers per pool only to a tenant's key (its own pools) or with
        `server.health_details`: pool names are no one else's business."""
        live = self._ingress.live_workers()
        ok = all(n > 0 for n in live.values()) and not self._drain.draining
        status = "draining" if self._drain.draining else "ok" if ok else "unavailable"
        body: dict[str, Any] = {"status": status}
        config = self._ingress.config
        if config.server.health_details:
            body["live_workers"] = live
        else:
            tenant = config.tenant_for_api_key(api_key_from_metadata(request.headers.items()))
            if tenant is not None and tenant.api_key is not None:
                body["live_workers"] = {p: live[p] for p in config.visible_pools(tenant) if p in live}
        return JSONResponse(body, status_code=200 if ok else 503)


# ----- the server -------------------------------------------------------------------------


class _TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus a header timeout: a connection that has not sent a
    complete request head within `header_timeout_s` (fresh, or idle then trickling) is
    closed. uvicorn itself only times out idle keep-alive connections."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm_header_timer()
        super().data_received(data)
        if not self._between_requests() and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process (a Ray actor) owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """A running uvicorn server on the current event loop; `stop()` ends it."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self._server = server
        self._task = task
        self.port = port

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close connections (open streams are cancelled), wait for the task."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def start_http_server(
    ingress: Front, host: str = "0.0.0.0", port: int = 8000, *, drain: Drain | None = None
) -> HttpServer:
    """Serve the OpenAI endpoints of `ingress` on host:port (0 picks a free port).

    Must be called on the event loop that serves the ingress. Raises OSError
    naming the address when it cannot be bound. Body limit, timeouts and TLS
    come from `ingress.config.server`; `drain` is shared with the gRPC front.
    """
    limits = ingress.config.server
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # replicas share the port
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind the OpenAI HTTP server to {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    protocol = type("TimedH11Protocol", (_TimedH11Protocol,), {"header_timeout_s": limits.header_timeout_s})
    config = uvicorn.Config(
        build_app(ingress, drain),
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        http=protocol,
        timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
        ssl_certfile=limits.tls_cert_file,
        ssl_keyfile=limits.tls_key_file,
    )
    server = _EmbeddedServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():  # startup failed; surface its error
            sock.close()
            task.result()
            raise RuntimeError("the OpenAI HTTP server stopped during startup")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])


__all__ = [
    "GenerationResponse",
    "HttpServer",
    "OpenAIRequest",
    "build_app",
    "chat_prompt",
    "error_body",
    "parse_request",
    "resolve_pool",
    "start_http_server",
]
