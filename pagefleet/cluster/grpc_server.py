"""The `pagefleet.v1.Generation` gRPC service over an `Ingress`, plus health and reflection.

The servicer only translates: wire messages to a `Submission` for
`Front.submit`, ingress deltas to `GenerateResponse`, and `IngressError`
codes to gRPC status codes (`errors.WIRE_STATUS`).
Routing, fault handling and aborts live in `pagefleet.cluster.ingress`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagefleet.cluster.api import (
    Front,
    IngressError,
    StreamDelta,
    Submission,
    Target,
    api_key_from_metadata,
    request_id_or_new,
    sampling_params,
    session_id_from_metadata,
    structured_output,
)
from pagefleet.cluster.drain import Drain
from pagefleet.cluster.errors import WIRE_STATUS, InvalidArgument
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.cluster.status import PoolStatus

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

HEALTH_INTERVAL_S = 0.5  # how often the health service re-reads worker liveness
UNREQUESTED_CALL_LIMIT_S = 3600
# Calls gRPC core holds for the server before cancelling new ones (see start_grpc_server).
PENDING_CALL_LIMIT = 100_000


def request_from_proto(msg: pb.GenerateRequest) -> Submission:
    """Validate a wire request; raises `InvalidArgument` with the reason.

    Proto3 cannot tell an unset number from 0: `max_tokens`, `n`, `top_p` and
    `repetition_penalty` 0 mean unset (the defaults of `sampling_params`), as do an absent `seed`
    and `logprobs`.
    """
    has_text = bool(msg.prompt)
    has_ids = len(msg.prompt_token_ids) > 0
    if has_text and has_ids:
        raise InvalidArgument("set exactly one of prompt and prompt_token_ids, not both")
    if not has_text and not has_ids:
        raise InvalidArgument("prompt is empty: set prompt or prompt_token_ids")
    s = msg.sampling
    params = sampling_params(
        max_tokens=s.max_tokens or None,
        n=s.n or None,
        temperature=s.temperature,
        top_p=s.top_p or None,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty or None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        structured=structured_output(
            json_schema=s.json_schema or None,
            json_object=s.json_object,
            regex=s.regex or None,
            choice=tuple(s.choice) or None,
        ),
    )
    return Submission(
        target=Target(msg.pool, adapter=msg.adapter),
        prompt=msg.prompt if has_text else tuple(msg.prompt_token_ids),
        params=params,
        request_id=request_id_or_new(msg.request_id),
        priority=msg.priority,
    )


def delta_to_proto(delta: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=delta.finish_reason or "",
        worker_id=delta.worker_id,
        index=delta.index,
    )
    for token_id, logprob, top in delta.logprobs or ():
        entry = msg.logprobs.add(token_id=token_id, logprob=logprob)
        for alt_id, alt_logprob in top:
            entry.top_logprobs.add(token_id=alt_id, logprob=alt_logprob)
    if delta.finish_reason:
        msg.usage.prompt_tokens = delta.prompt_tokens
        msg.usage.completion_tokens = delta.completion_tokens
        msg.usage.cached_tokens = delta.cached_tokens
    return msg


def status_to_proto(pools: Sequence[PoolStatus]) -> pb.StatusResponse:
    """GetStatus's answer: every proto field read from the typed status of the same name."""
    return pb.StatusResponse(
        pools=[
            pb.PoolStatus(
                **_proto_fields(pb.PoolStatus, pool, skip="workers"),
                workers=[pb.WorkerStatus(**_proto_fields(pb.WorkerStatus, w)) for w in pool.workers],
            )
            for pool in pools
        ]
    )


def _proto_fields(message: type[Message], status: object, skip: str = "") -> dict[str, Any]:
    return {f.name: getattr(status, f.name) for f in message.DESCRIPTOR.fields if f.name != skip}


class GenerationServicer(pb_grpc.GenerationServicer):
    """gRPC front of one `Ingress`."""

    def __init__(self, ingress: Front, drain: Drain | None = None) -> None:
        self._ingress = ingress
        self._drain = drain or Drain(ingress)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            metadata = context.invocation_metadata()
            tenant = self._ingress.tenancy.authenticate(api_key_from_metadata(metadata))
            sub = request_from_proto(request)
            session = session_id_from_metadata(metadata, self._ingress.config.router.session_header)
            # Which ingress replica serves the stream (several share the port).
            await context.send_initial_metadata((("x-pagefleet-replica", self._ingress.replica_id),))
            stream = self._drain.submit(
                tenant, sub.target, sub.prompt, sub.params,
                request_id=sub.request_id, priority=sub.priority, session=session, grpc=True,
            )  # fmt: skip
            async for delta in stream:
                yield delta_to_proto(delta)
        except IngressError as exc:
            await context.abort(WIRE_STATUS[exc.code].grpc, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: say so with INTERNAL, never a bare UNKNOWN
            logger.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            tenant = self._ingress.tenancy.authenticate(
                api_key_from_metadata(context.invocation_metadata())
            )
        except IngressError as exc:
            await context.abort(WIRE_STATUS[exc.code].grpc, exc.message)
        await context.send_initial_metadata((("x-pagefleet-replica", self._ingress.replica_id),))
        # Scoped to the caller: another tenant's request of this id is "not found". Any
        # replica finds it: the one that holds it, or the workers on behalf of another.
        return pb.AbortResponse(found=await self._ingress.abort(request.request_id, tenant.name))

    async def GetStatus(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        try:
            tenant = self._ingress.tenancy.authenticate(
                api_key_from_metadata(context.invocation_metadata())
            )
            pools = self._ingress.status(request.pool or None, tenant)
        except IngressError as exc:
            await context.abort(WIRE_STATUS[exc.code].grpc, exc.message)
        return status_to_proto(pools)


def serving_status(
    ingress: Front, drain: Drain
) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    """SERVING while `Drain.serving` (as the HTTP /health says), else NOT_SERVING."""
    ok = drain.serving(ingress.live_workers())
    return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING


async def _track_health(
    server: grpc.aio.Server,
    ingress: Front,
    health_servicer: health.aio.HealthServicer,
    drain: Drain,
) -> None:
    """Keep the health service's answer in step with worker liveness until the server stops."""
    last = None
    while True:
        status = serving_status(ingress, drain)
        if status != last:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            last = status
        if not await server.wait_for_termination(timeout=HEALTH_INTERVAL_S):
            return  # terminated (True would mean the wait timed out)


# Strong references to the health trackers: the event loop keeps only weak ones.
_health_tasks: set[asyncio.Task[None]] = set()


class _Undecodable:
    """A request whose bytes are no valid message (corrupt wire format, invalid UTF-8)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(cls: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    """A deserializer that hands a bad message to the method (INVALID_ARGUMENT there)
    instead of failing inside gRPC, which would answer a bare UNKNOWN/INTERNAL."""

    def parse(data: bytes) -> Message | _Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Undecodable(f"request is not a valid {cls.DESCRIPTOR.full_name}: {exc}")

    return parse


def _checked(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return call


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register the Generation service (as the generated `add_GenerationServicer_to_server`
    does) with deserializers that turn undecodable bytes into INVALID_ARGUMENT."""

    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for msg in servicer.Generate(request, context):
            yield msg

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            _checked(servicer.Abort),
            request_deserializer=_lenient(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            _checked(servicer.GetStatus),
            request_deserializer=_lenient(pb.StatusRequest),
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files (the same pair the HTTP server uses)."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


async def start_grpc_server(
    ingress: Front, host: str = "0.0.0.0", port: int = 50051, *, drain: Drain | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start the Generation, health and reflection services; returns the server and its bound port.

    Must be called on the event loop that will serve the calls (the ingress's).
    Port 0 picks a free port. Message size limit and TLS come from
    `ingress.config.server`; `drain` is shared with the HTTP front.
    """
    cfg = ingress.config.server
    drain = drain or Drain(ingress)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # The ingress replicas of one node share the port; the kernel spreads
            # connections over them.
            ("grpc.so_reuseport", 1),
            # gRPC core ends a call the server has not picked up within this (30 s by
            # default) with a bare CANCELLED. Under a flood the event loop picks calls up
            # late; each must still get the admission's answer (RESOURCE_EXHAUSTED with
            # the pool's numbers, UNAVAILABLE) or meet its client's own deadline.
            ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_LIMIT_S),
            # Past 1,000 calls not yet picked up (its soft limit) gRPC core cancels new
            # ones at random, more the closer to 3,000 (its hard limit), with a bare
            # CANCELLED: a flood of 2,000 streams lost about 9% that way. Admission
            # answers each call with its reason instead; gRPC's cut comes only here.
            ("grpc.server.max_pending_requests", PENDING_CALL_LIMIT),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALL_LIMIT),
        ]
    )
    add_generation_service(GenerationServicer(ingress, drain), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    if cfg.tls_cert_file is not None and cfg.tls_key_file is not None:
        bound = server.add_secure_port(address, server_credentials(cfg.tls_cert_file, cfg.tls_key_file))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()

    async def not_serving() -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    drain.on_start(not_serving)
    task = asyncio.get_running_loop().create_task(
        _track_health(server, ingress, health_servicer, drain)
    )
    _health_tasks.add(task)
    task.add_done_callback(_health_tasks.discard)
    await asyncio.sleep(0)  # the first status is set before anyone can ask
    return server, bound
