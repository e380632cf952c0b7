"""The errors the ingress raises, and the one table that turns them into wire codes.

Every refusal or failure of a request is an `IngressError` whose `code` says
why and whose message says what to fix (the limit, the field). The fronts
never choose a status themselves: gRPC answers `WIRE_STATUS[code].grpc`, HTTP
answers `WIRE_STATUS[code].http` with OpenAI's error `type` and `code`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import grpc


class ErrorCode(enum.Enum):
    """Why the ingress refused or ended a request."""

    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class IngressError(Exception):
    """A request the ingress cannot serve; `code` says why, `message` says what to fix."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> IngressError:
        """The typed error of `code` (a worker's error code arrives as a string)."""
        return _BY_CODE[code](message)


class InvalidArgument(IngressError):
    """Bad input; the message names the field and the limit."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_ARGUMENT, message)


class Unauthenticated(IngressError):
    """No API key, or one no tenant has."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHENTICATED, message)


class PermissionDenied(IngressError):
    """A known tenant asked for something it may not use."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PERMISSION_DENIED, message)


class NotFound(IngressError):
    """An unknown pool or model, or one the caller may not see (the same answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, message)


class AlreadyExists(IngressError):
    """A request id the tenant already has running."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ALREADY_EXISTS, message)


class ResourceExhausted(IngressError):
    """Queues full: retry later (the message names the limit)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, message)


class Unavailable(IngressError):
    """No live worker for the pool, or the server is shutting down."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


class Internal(IngressError):
    """A worker failed on this request (its engine, not the client)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


_BY_CODE: dict[ErrorCode, Callable[[str], IngressError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.ALREADY_EXISTS: AlreadyExists,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.INTERNAL: Internal,
}


@dataclass(frozen=True)
class WireStatus:
    """How one error code reads on each wire."""

    grpc: grpc.StatusCode
    http: int
    # OpenAI's error object: `{"error": {"type": openai_type, "code": openai_code}}`.
    openai_type: str
    openai_code: str


WIRE_STATUS: dict[ErrorCode, WireStatus] = {
    ErrorCode.INVALID_ARGUMENT: WireStatus(
        grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_argument"
    ),
    ErrorCode.UNAUTHENTICATED: WireStatus(
        grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "unauthenticated"
    ),
    ErrorCode.PERMISSION_DENIED: WireStatus(
        grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error", "permission_denied"
    ),
    ErrorCode.NOT_FOUND: WireStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", "model_not_found"),
    ErrorCode.ALREADY_EXISTS: WireStatus(
        grpc.StatusCode.ALREADY_EXISTS, 409, "conflict_error", "already_exists"
    ),
    # Queues full: 429 makes OpenAI clients back off and retry.
    ErrorCode.RESOURCE_EXHAUSTED: WireStatus(
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "resource_exhausted"
    ),
    ErrorCode.UNAVAILABLE: WireStatus(
        grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "unavailable"
    ),
    ErrorCode.INTERNAL: WireStatus(grpc.StatusCode.INTERNAL, 500, "server_error", "internal"),
}
