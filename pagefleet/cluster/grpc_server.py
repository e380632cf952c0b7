"""The `pagefleet.v1.Generation` gRPC service over an `Ingress`, plus health and reflection.

The servicer only translates: wire messages to `GenerationRequest`, ingress
deltas to `GenerateResponse`, and `IngressError` codes to gRPC status codes.
Routing, fault handling and aborts live in `pagefleet.cluster.ingress`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagefleet.cluster.ingress import (
    ErrorCode,
    GenerationRequest,
    Ingress,
    IngressError,
    StreamDelta,
)
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

_STATUS_CODES = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

DEFAULT_MAX_TOKENS = 16
HEALTH_INTERVAL_S = 0.5  # how often the health service re-reads worker liveness


def api_key_from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The client's API key: `x-api-key: KEY` or `authorization: Bearer KEY`."""
    for key, value in metadata or ():
        text = value.decode() if isinstance(value, bytes) else str(value)
        if key == "x-api-key":
            return text
        if key == "authorization" and text.lower().startswith("bearer "):
            return text[len("bearer ") :].strip()
    return None


def request_from_proto(
    msg: pb.GenerateRequest, *, pool: str | None = None, salt: str | None = None
) -> GenerationRequest:
    """Validate a wire request; raises `IngressError(INVALID_ARGUMENT)` with the reason.

    `pool` and `salt` come from the authenticated tenant (the server sets the
    prefix-cache salt, never the client).
    """
    has_text = bool(msg.prompt)
    has_ids = len(msg.prompt_token_ids) > 0
    if has_text and has_ids:
        raise IngressError(
            ErrorCode.INVALID_ARGUMENT, "set exactly one of prompt and prompt_token_ids, not both"
        )
    if not has_text and not has_ids:
        raise IngressError(ErrorCode.INVALID_ARGUMENT, "prompt is empty: set prompt or prompt_token_ids")
    s = msg.sampling
    sampling: dict[str, Any] = {
        "max_tokens": s.max_tokens if s.max_tokens != 0 else DEFAULT_MAX_TOKENS,
        "temperature": s.temperature,
        "top_p": s.top_p if s.top_p != 0 else 1.0,
        "top_k": s.top_k,
        "seed": s.seed if s.HasField("seed") else None,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    try:
        return GenerationRequest.create(
            request_id=msg.request_id,
            prompt=msg.prompt if has_text else list(msg.prompt_token_ids),
            sampling=sampling,
            priority=msg.priority,
            pool=msg.pool if pool is None else pool,
            salt=salt,
        )
    except ValueError as exc:  # SamplingParams validation names the field and the limit
        raise IngressError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc


def delta_to_proto(delta: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=delta.finish_reason or "",
        worker_id=delta.worker_id,
    )
    if delta.finish_reason:
        msg.usage.prompt_tokens = delta.prompt_tokens
        msg.usage.completion_tokens = delta.completion_tokens
        msg.usage.cached_tokens = delta.cached_tokens
    return msg


class GenerationServicer(pb_grpc.GenerationServicer):
    """gRPC front of one `Ingress`."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            tenant = self._ingress.authenticate(api_key_from_metadata(context.invocation_metadata()))
            pool = self._ingress.tenant_pool(tenant, request.pool)
            req = request_from_proto(request, pool=pool, salt=tenant.cache_salt())
            # Which ingress replica serves the stream (several share the port).
            await context.send_initial_metadata((("x-pagefleet-replica", self._ingress.replica_id),))
            async for delta in self._ingress.generate(req):
                yield delta_to_proto(delta)
        except IngressError as exc:
            await context.abort(_STATUS_CODES[exc.code], exc.message)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            self._ingress.authenticate(api_key_from_metadata(context.invocation_metadata()))
        except IngressError as exc:
            await context.abort(_STATUS_CODES[exc.code], exc.message)
        return pb.AbortResponse(found=await self._ingress.abort(request.request_id))

    async def GetStatus(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        try:
            self._ingress.authenticate(api_key_from_metadata(context.invocation_metadata()))
            pools = self._ingress.status(request.pool or None)
        except IngressError as exc:
            await context.abort(_STATUS_CODES[exc.code], exc.message)
        return json_format.ParseDict({"pools": pools}, pb.StatusResponse())


def serving_status(ingress: Ingress) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    """SERVING while every pool has a live worker (as the HTTP /health says), else NOT_SERVING."""
    ok = all(n > 0 for n in ingress.live_workers().values())
    return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING


async def _track_health(
    server: grpc.aio.Server, ingress: Ingress, health_servicer: health.aio.HealthServicer
) -> None:
    """Keep the health service's answer in step with worker liveness until the server stops."""
    last = None
    while True:
        status = serving_status(ingress)
        if status != last:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            last = status
        if not await server.wait_for_termination(timeout=HEALTH_INTERVAL_S):
            return  # terminated (True would mean the wait timed out)


# Strong references to the health trackers: the event loop keeps only weak ones.
_health_tasks: set[asyncio.Task[None]] = set()


async def start_grpc_server(ingress: Ingress, host: str = "0.0.0.0", port: int = 50051) -> tuple[grpc.aio.Server, int]:
    """Start the Generation, health and reflection services; returns the server and its bound port.

    Must be called on the event loop that will serve the calls (the ingress's).
    Port 0 picks a free port.
    """
    # SO_REUSEPORT: the ingress replicas of one node share the port; the kernel spreads
    # connections over them.
    server = grpc.aio.server(options=(("grpc.so_reuseport", 1),))
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(ingress), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    task = asyncio.get_running_loop().create_task(_track_health(server, ingress, health_servicer))
    _health_tasks.add(task)
    task.add_done_callback(_health_tasks.discard)
    await asyncio.sleep(0)  # the first status is set before anyone can ask
    return server, bound
