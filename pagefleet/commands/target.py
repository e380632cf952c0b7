"""`--target` of the client commands: the address of a pagefleet gRPC server.

Accepted: `host`, `host:port`, `grpc://host:port` and `[v6addr]:port`; the
port defaults to 50051, the gRPC port of `pagefleet serve`. An `http(s)://`
URL is refused with a pointer to the gRPC port, since that is the OpenAI
HTTP API's scheme.
"""

from __future__ import annotations

from typing import Any

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000

TARGET_HELP = (
    f"gRPC address of a pagefleet server: HOST, HOST:PORT or grpc://HOST:PORT "
    f"(port {DEFAULT_GRPC_PORT} when omitted)"
)


def parse_target(target: str) -> str:
    """`host:port` for grpc from a `--target` value; ValueError says what is wrong."""
    value = target.strip()
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme.lower() in ("http", "https"):
            raise ValueError(
                f"{target!r} is an HTTP URL; --target takes the gRPC address "
                f"(e.g. grpc://HOST:{DEFAULT_GRPC_PORT}), the OpenAI HTTP API is on port "
                f"{DEFAULT_HTTP_PORT} by default"
            )
        if scheme.lower() != "grpc":
            raise ValueError(f"{target!r}: unknown scheme {scheme!r}; use HOST:PORT or grpc://HOST:PORT")
        value = rest
    value = value.rstrip("/")
    if not value or "/" in value:
        raise ValueError(f"{target!r} is not HOST, HOST:PORT or grpc://HOST:PORT")
    if value.startswith("["):  # [v6]:port or [v6]
        host, _, port = value[1:].partition("]")
        port = port.removeprefix(":")
        host = f"[{host}]"
    elif value.count(":") == 1:
        host, port = value.split(":")
    elif ":" in value:  # a bare IPv6 address
        host, port = f"[{value}]", ""
    else:
        host, port = value, ""
    if not host or host == "[]":
        raise ValueError(f"{target!r} has no host")
    if port == "":
        return f"{host}:{DEFAULT_GRPC_PORT}"
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{target!r}: port must be a number in [1, 65535], got {port!r}")
    return f"{host}:{int(port)}"


def describe_rpc_error(target: str, exc: Any) -> str:
    """One line for a failed call to `target`: the gRPC code, its details and what to check."""
    code = exc.code().name if hasattr(exc, "code") and exc.code() is not None else "ERROR"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    line = f"{target}: {code}: {details}"
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNKNOWN"):
        port = target.rsplit(":", 1)[-1]
        hint = (
            f"port {port} is the OpenAI HTTP port by default; the gRPC port is {DEFAULT_GRPC_PORT}"
            if port == str(DEFAULT_HTTP_PORT)
            else f"check that `pagefleet serve` runs there and that {port} is its gRPC port "
            f"(`pagefleet serve` prints it; default {DEFAULT_GRPC_PORT})"
        )
        line += f" ({hint})"
    return line
