"""A small blocking gRPC client of the `pagefleet.v1.Generation` service.

Used by `pagefleet generate --target` and `pagefleet status`; importing it
needs only grpcio and protobuf (no torch, no Ray).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

# Fields of SamplingParams that the wire message carries.
_SAMPLING_FIELDS = (
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
# The structured-output fields of the wire message (`SamplingParams.structured` there).
_STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "json_object")


def sampling_to_proto(params: Any = None, **overrides: Any) -> pb.SamplingParams:
    """Build the wire `SamplingParams` from an object with the engine's field names.

    `params` may be a `pagefleet.SamplingParams`, any object or mapping with
    those attributes, or None; keyword overrides win.
    """
    values: dict[str, Any] = {}
    structured = getattr(params, "structured", None)  # a StructuredOutput
    if structured is not None:
        values.update({name: getattr(structured, name) for name in _STRUCTURED_FIELDS})
    for name in (*_SAMPLING_FIELDS, *_STRUCTURED_FIELDS):
        if isinstance(params, dict):
            if name in params:
                values[name] = params[name]
        elif params is not None and hasattr(params, name):
            values[name] = getattr(params, name)
    values.update(overrides)
    msg = pb.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        if name == "json_schema" and not isinstance(value, str):
            msg.json_schema = json.dumps(value)  # a schema as a dict
        elif name in ("stop", "stop_token_ids", "choice"):
            getattr(msg, name).extend([value] if isinstance(value, (str, int)) else value)
        elif name == "logit_bias":  # SamplingParams' (id, bias) pairs, or a mapping
            msg.logit_bias.update(dict(value))
        else:
            setattr(msg, name, value)
    return msg


def build_request(
    prompt: str | Sequence[int],
    params: Any = None,
    *,
    request_id: str = "",
    pool: str = "",
    priority: int = 0,
) -> pb.GenerateRequest:
    """A `GenerateRequest` for a text prompt or a list of token ids."""
    req = pb.GenerateRequest(
        request_id=request_id,
        sampling=sampling_to_proto(params),
        priority=priority,
        pool=pool,
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(int(t) for t in prompt)
    return req


# A PEM CA file here makes every client call use TLS (for servers with server.tls_cert_file).
TLS_CA_ENV = "PAGEFLEET_TLS_CA"


def open_channel(target: str, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to `target`: TLS verified against the PEM CA file `tls_ca` (default
    `$PAGEFLEET_TLS_CA`), plaintext when neither is set."""
    ca = tls_ca if tls_ca is not None else os.environ.get(TLS_CA_ENV)
    if not ca:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    return grpc.secure_channel(target, creds)


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """Call metadata carrying `api_key` as a bearer token (nothing when None)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def stream_generate(
    target: str,
    prompt: str | Sequence[int],
    params: Any = None,
    *,
    request_id: str = "",
    pool: str = "",
    priority: int = 0,
    timeout: float | None = None,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> Iterator[pb.GenerateResponse]:
    """Stream one generation from the server at `target` ("host:port").

    Yields `GenerateResponse` messages: `.token_ids` and `.text` are the new
    tokens since the previous message; the last one has `.finish_reason` and
    `.usage`. Closing the generator early cancels the call, which aborts the
    request on its worker. Raises `grpc.RpcError` on failure (`.code()` tells
    which: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, NOT_FOUND).
    `tls_ca`: see `open_channel`.
    """
    request = build_request(prompt, params, request_id=request_id, pool=pool, priority=priority)
    with open_channel(target, tls_ca) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(
            request, timeout=timeout, metadata=auth_metadata(api_key)
        )
        try:
            yield from call
        finally:
            call.cancel()  # no-op when the stream already ended


def get_status(
    target: str,
    pool: str = "",
    timeout: float | None = 10.0,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> pb.StatusResponse:
    """The server's per pool and per worker KV block counters (of the caller's pools)."""
    with open_channel(target, tls_ca) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return stub.GetStatus(
            pb.StatusRequest(pool=pool), timeout=timeout, metadata=auth_metadata(api_key)
        )


def abort(
    target: str,
    request_id: str,
    timeout: float | None = 10.0,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> bool:
    """Abort one of the caller's running requests by id; False when it has none of that id."""
    with open_channel(target, tls_ca) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reply = stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=auth_metadata(api_key)
        )
        return bool(reply.found)


def format_status(status: pb.StatusResponse) -> str:
    """A per-worker table of a `StatusResponse`, one block per pool."""
    columns = (
        ("worker", 24),
        ("alive", 5),
        ("node", 24),
        ("total", 6),
        ("free", 6),
        ("live", 6),
        ("cached", 6),
        ("peak", 6),
        ("run", 4),
        ("wait", 4),
        ("hit%", 6),
        ("routed", 7),
        ("moved", 6),
    )
    header = " ".join(name.rjust(width) if i else name.ljust(width) for i, (name, width) in enumerate(columns))
    lines: list[str] = []
    for pool in status.pools:
        lines.append(
            f"pool {pool.name}: model={pool.model} router={pool.router_policy} "
            f"live_workers={pool.live_workers}/{len(pool.workers)} target={pool.target_workers} "
            f"blocks free={pool.free_blocks} live={pool.live_blocks} "
            f"cached={pool.cached_blocks} total={pool.total_blocks} "
            f"hit_rate={100 * pool.hit_rate:.1f}% migrations={pool.migrations}"
            + (f" last_scaled=({pool.scale_reason})" if pool.scale_reason else "")
        )
        lines.append(header)
        for w in pool.workers:
            cells = (
                w.worker_id,
                "yes" if w.alive else "no",
                f"{w.node_ip} {w.node_id[:8]}".strip(),
                w.total_blocks,
                w.free_blocks,
                w.live_blocks,
                w.cached_blocks,
                w.peak_live_blocks,
                w.num_running,
                w.num_waiting,
                f"{100 * w.hit_rate:.1f}",
                w.requests_routed,
                w.migrations_out,
            )
            lines.append(
                " ".join(
                    str(c).rjust(width) if i else str(c).ljust(width)
                    for i, (c, (_, width)) in enumerate(zip(cells, columns, strict=False))
                )
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n")
