"""What the fronts (gRPC, OpenAI HTTP, dashboard, drain) share with the ingress.

The wire protocols depend on this module and on nothing of each other: the
request and delta types, the error codes, the API-key rule, and `Front`, the
interface of the ingress they serve (`pagefleet.cluster.ingress.Ingress`
implements it). Authentication and the pool rule are `Front.tenancy`
(`pagefleet.cluster.tenancy`); errors and their wire codes are
`pagefleet.cluster.errors`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagefleet.cluster.config import ClusterConfig, TenantConfig
from pagefleet.cluster.errors import ErrorCode, IngressError, InvalidArgument
from pagefleet.cluster.status import PoolStatus
from pagefleet.cluster.tenancy import Target, Tenancy
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.structured_output import StructuredOutput

# A client's request_id is echoed in every message and kept while the request runs.
MAX_REQUEST_ID_CHARS = 256
# A session id is kept (as a pin, on every ingress replica and the scheduler) for
# `router.session_ttl_s` after its last request: short, and plain text.
MAX_SESSION_ID_CHARS = 128


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id a request has inside the cluster (ingress tables, workers): unique per tenant.

    Two tenants may use the same request_id; the length prefix keeps every
    (tenant, id) pair distinct whatever characters either holds.
    """
    return f"{len(tenant)}:{tenant}:{request_id}"


def request_id_or_new(request_id: str) -> str:
    """The client's request_id, or a fresh one when it sent none; INVALID_ARGUMENT past
    `MAX_REQUEST_ID_CHARS`."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )
    return request_id or uuid.uuid4().hex


def sampling_params(**fields: Any) -> SamplingParams:
    """The `SamplingParams` of a wire request, the one place unset fields get their defaults.

    A field the client left unset is passed as None and takes `SamplingParams`'
    default; a bad value is INVALID_ARGUMENT naming the field and the limit.
    """
    try:
        return SamplingParams(**{name: value for name, value in fields.items() if value is not None})
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from exc


def structured_output(
    *,
    json_schema: Any = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Any = None,
) -> StructuredOutput | None:
    """The `StructuredOutput` of a wire request, None when it sets none of the fields.

    Only the cheap checks run here (one kind, JSON that parses, the 64 KiB
    bound); compiling is the worker's. A bad value is INVALID_ARGUMENT naming it.
    """
    if json_schema is None and not json_object and regex is None and choice is None:
        return None
    try:
        return StructuredOutput(
            json_schema=json_schema, json_object=json_object, regex=regex,
            choice=None if choice is None else tuple(choice),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from exc


@dataclass(frozen=True)
class Submission:
    """A generation request as a front parsed it from its wire: what `Front.submit` takes
    besides the tenant. The prompt is text or token ids; the ingress tokenizes it."""

    target: Target
    prompt: str | tuple[int, ...]
    params: SamplingParams
    request_id: str = ""
    priority: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One admitted generation request inside the ingress: tokenized, its pool and salt set.

    Built by `Ingress.submit` from what a front passed; `tenant` (the
    authenticated tenant's name) scopes `request_id`: ids, aborts and
    duplicates are per tenant.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    pool: str = ""
    salt: str | None = None
    # The authenticated tenant's name: its fair share of the pool's wait queue,
    # and the scope of its request ids.
    tenant: str = ""
    # The pool's LoRA adapter it runs with (None: the base model) and that adapter's
    # `name:hash` identity, which its prefix hashes carry as the worker's do.
    adapter: str | None = None
    adapter_id: str | None = None
    # The client's session (`x-session-id`), "" for none: routed to its session's worker.
    session_id: str = ""

    @property
    def key(self) -> str:
        """`scoped_request_id(tenant, request_id)`: the id workers and the ingress tables use."""
        return scoped_request_id(self.tenant, self.request_id)


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one completion (`index`, of the request's `n`) since its previous
    delta; each completion's last delta has its `finish_reason`. `completion_tokens`
    counts the tokens of every completion so far (the request's last delta: the total)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    worker_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With SamplingParams.logprobs: [token_id, logprob, [[id, logprob], ...]] per token.
    logprobs: list[Any] | None = None
    index: int = 0


def api_key_from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The client's API key: `x-api-key: KEY` or `authorization: Bearer KEY`."""
    for key, value in metadata or ():
        # Binary or non-UTF-8 header bytes are no key of ours (an unknown key, not a crash).
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if key == "x-api-key":
            return text
        if key == "authorization" and text.lower().startswith("bearer "):
            return text[len("bearer ") :].strip()
    return None


def session_id_from_metadata(metadata: Sequence[tuple[str, Any]] | None, header: str) -> str:
    """The client's session id: the first `header` (`router.session_header`) entry of the
    HTTP headers or gRPC metadata, "" without one. INVALID_ARGUMENT past
    `MAX_SESSION_ID_CHARS` or with a character outside printable ASCII."""
    for key, value in metadata or ():
        if key != header:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        if len(text) > MAX_SESSION_ID_CHARS:
            raise InvalidArgument(
                f"{header} must be at most {MAX_SESSION_ID_CHARS} characters, got {len(text)}"
            )
        if not (text.isascii() and text.isprintable()):
            raise InvalidArgument(f"{header} must be printable ASCII (0x20-0x7e), got {text[:40]!r}")
        return text
    return ""


class Front(Protocol):
    """What a front calls on the ingress it serves."""

    config: ClusterConfig
    tenancy: Tenancy
    replica_id: str

    def submit(
        self,
        tenant: TenantConfig,
        target: Target,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        session: str = "",
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream one request of `tenant` (of its `session`, "" for none); raises
        IngressError before or during the stream."""
        ...

    async def abort(self, request_id: str, tenant: str = "", *, anywhere: bool = True) -> bool:
        """Abort `tenant`'s request; False when it has none of that id. `anywhere`: also one
        another ingress replica streams (False: only this replica's own)."""
        ...

    def tokenizer(self, pool: str) -> Any:
        """The pool's tokenizer (None: the model has none)."""
        ...

    def status(self, pool: str | None = None, tenant: TenantConfig | None = None) -> list[PoolStatus]:
        """Per pool and per worker counters, as GetStatus reports them."""
        ...

    def live_workers(self) -> dict[str, int]:
        """Live workers per pool."""
        ...


__all__ = [
    "ErrorCode",
    "Front",
    "GenerationRequest",
    "IngressError",
    "StreamDelta",
    "Submission",
    "Target",
    "api_key_from_metadata",
    "request_id_or_new",
    "sampling_params",
    "scoped_request_id",
    "session_id_from_metadata",
    "structured_output",
]
