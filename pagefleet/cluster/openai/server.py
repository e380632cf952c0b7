"""The OpenAI HTTP server: routes and handlers, body limits, the uvicorn protocol, the socket.

Served by uvicorn on the ingress replica's own event loop (`start_http_server`),
so HTTP handlers, gRPC handlers and the Ray streaming calls share one loop.
Handlers authenticate with the ingress's `Tenancy` (as gRPC does), parse the
body into one typed request (`protocol`), and call `Front.submit` through
the shared `Drain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagefleet.cluster.api import (
    ErrorCode,
    Front,
    IngressError,
    Target,
    api_key_from_metadata,
    session_id_from_metadata,
)
from pagefleet.cluster.config import ServerConfig, TenantConfig
from pagefleet.cluster.dashboard import dashboard_routes
from pagefleet.cluster.drain import Drain
from pagefleet.cluster.errors import InvalidArgument, NotFound
from pagefleet.cluster.openai.formatting import ResponseFormat, error_body, error_response
from pagefleet.cluster.openai.protocol import chat_prompt, parse_request
from pagefleet.cluster.openai.streaming import GenerationResponse

logger = logging.getLogger(__name__)


# ----- reading the body -------------------------------------------------------------------


class BodyError(Exception):
    """A body refused before parsing: too large (413) or too slow (408)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json(request: Request, limits: ServerConfig) -> Any:
    """The JSON body, read within `max_body_bytes` and `body_timeout_s`.

    Raises `BodyError` (413, 408) or INVALID_ARGUMENT for a body that is not
    JSON, nests too deeply or holds a lone surrogate.
    """
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body of {declared} bytes exceeds server.max_body_bytes {limit}")

    async def read() -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"request body exceeds server.max_body_bytes {limit}")
            parts.append(chunk)
        return b"".join(parts)

    try:
        raw = await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise BodyError(
            408, f"request body not received within server.body_timeout_s {limits.body_timeout_s}s"
        ) from None
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """Decode a JSON body; INVALID_ARGUMENT naming what is wrong (never a 500)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidArgument("request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, invalid UTF-8, huge ints
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from exc
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
                raise InvalidArgument(
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
        return self._ingress.tenancy.authenticate(api_key_from_metadata(request.headers.items()))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            tenant = self._tenant(request)
            session = session_id_from_metadata(
                request.headers.items(), self._ingress.config.router.session_header
            )
            body = await read_json(request, self._ingress.config.server)
            parsed = parse_request(body, chat=chat)
            target = Target(parsed.model, "model")
            pool = self._ingress.tenancy.resolve(tenant, target).pool.name
            if chat:
                assert isinstance(parsed.prompt, list)
                # A chat template may tokenize: off the event loop, like text prompts.
                prompt = await asyncio.to_thread(
                    chat_prompt, parsed.prompt, self._ingress.tokenizer(pool), parsed.tools  # type: ignore[arg-type]
                )
            else:
                prompt = parsed.prompt  # type: ignore[assignment]
        except IngressError as exc:
            return error_response(exc)
        except BodyError as exc:
            return JSONResponse(error_body(ErrorCode.INVALID_ARGUMENT, str(exc)), status_code=exc.status)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tokenizer = self._ingress.tokenizer(pool) if parsed.params.logprobs is not None else None
        fmt = ResponseFormat(
            chat, request_id, parsed.model or pool, int(time.time()), tokenizer, parsed.return_logprobs
        )
        deltas = self._drain.submit(
            tenant, target, prompt, parsed.params, request_id=request_id, priority=parsed.priority,
            session=session,
        )  # fmt: skip
        return GenerationResponse(
            deltas, fmt, stream=parsed.stream, include_usage=parsed.include_usage,
            candidates=parsed.params.n, choices=parsed.choices,
        )  # fmt: skip

    def _model_entry(self, pool_name: str, adapter: str | None = None) -> dict[str, Any]:
        """A pool's entry (`parent` None), or one of its LoRA adapters' (`parent`: the pool,
        as vLLM lists adapters beside their base model; `root`: the adapter's name, no
        server path)."""
        pool = self._ingress.config.pool(pool_name)
        entry: dict[str, Any] = {
            "id": adapter or pool.name,
            "object": "model",
            "created": self._created,
            "owned_by": "pagefleet",
            "root": adapter or str(pool.engine.model),
            "parent": pool.name if adapter else None,
        }
        if pool.engine.max_model_len is not None:  # else the model's own limit, unknown here
            entry["max_model_len"] = pool.engine.max_model_len
        return entry

    def _model_entries(self, tenant: TenantConfig) -> dict[str, dict[str, Any]]:
        """Every model id the tenant may name, pools first, each pool's adapters after it."""
        tenancy = self._ingress.tenancy
        entries: dict[str, dict[str, Any]] = {}
        for pool in tenancy.visible_pools(tenant):
            entries[pool] = self._model_entry(pool)
            for adapter in tenancy.adapters(tenant, pool):
                entries.setdefault(adapter, self._model_entry(pool, adapter))
        return entries

    async def models(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
        except IngressError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": list(self._model_entries(tenant).values())})

    async def model(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
            name = request.path_params["model"]
            entry = self._model_entries(tenant).get(name)
            if entry is None:
                raise NotFound(f"model {name!r} does not exist")
        except IngressError as exc:
            return error_response(exc)
        return JSONResponse(entry)

    async def health(self, request: Request) -> Response:
        """200 when every pool has a live worker, else 503 (also while draining). Live
        workers per pool only to a tenant's key (its own pools) or with
        `server.health_details`: pool names are no one else's business."""
        live = self._ingress.live_workers()
        ok = self._drain.serving(live)
        status = "draining" if self._drain.draining else "ok" if ok else "unavailable"
        body: dict[str, Any] = {"status": status}
        tenancy = self._ingress.tenancy
        if self._ingress.config.server.health_details:
            body["live_workers"] = live
        else:
            tenant = tenancy.tenant_for_api_key(api_key_from_metadata(request.headers.items()))
            if tenant is not None and tenant.api_key is not None:
                body["live_workers"] = {p: live[p] for p in tenancy.visible_pools(tenant) if p in live}
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


__all__ = ["HttpServer", "build_app", "read_json", "start_http_server"]
