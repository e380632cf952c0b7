from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = (
        "choice",
        "frequency_penalty",
        "ignore_eos",
        "json_object",
        "json_schema",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "min_p",
        "n",
        "presence_penalty",
        "regex",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_k",
        "top_p",
    )
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: int | None = ..., value: float | None = ...) -> None: ...

    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    json_object: bool
    n: int
    def __init__(
        self,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        stop: _Iterable[str] | None = ...,
        stop_token_ids: _Iterable[int] | None = ...,
        ignore_eos: bool | None = ...,
        logprobs: int | None = ...,
        min_p: float | None = ...,
        repetition_penalty: float | None = ...,
        presence_penalty: float | None = ...,
        frequency_penalty: float | None = ...,
        logit_bias: _Mapping[int, float] | None = ...,
        json_schema: str | None = ...,
        regex: str | None = ...,
        choice: _Iterable[str] | None = ...,
        json_object: bool | None = ...,
        n: int | None = ...,
    ) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = (
        "adapter",
        "pool",
        "priority",
        "prompt",
        "prompt_token_ids",
        "request_id",
        "sampling",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    pool: str
    adapter: str
    def __init__(
        self,
        request_id: str | None = ...,
        prompt: str | None = ...,
        prompt_token_ids: _Iterable[int] | None = ...,
        sampling: SamplingParams | _Mapping | None = ...,
        priority: int | None = ...,
        pool: str | None = ...,
        adapter: str | None = ...,
    ) -> None: ...

class Usage(_message.Message):
    __slots__ = ("cached_tokens", "completion_tokens", "prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(
        self,
        prompt_tokens: int | None = ...,
        completion_tokens: int | None = ...,
        cached_tokens: int | None = ...,
    ) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("logprob", "token_id")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: int | None = ..., logprob: float | None = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "token_id", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(
        self,
        token_id: int | None = ...,
        logprob: float | None = ...,
        top_logprobs: _Iterable[TopLogprob | _Mapping] | None = ...,
    ) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = (
        "finish_reason",
        "index",
        "logprobs",
        "request_id",
        "text",
        "token_ids",
        "usage",
        "worker_id",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    worker_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(
        self,
        request_id: str | None = ...,
        token_ids: _Iterable[int] | None = ...,
        text: str | None = ...,
        finish_reason: str | None = ...,
        usage: Usage | _Mapping | None = ...,
        worker_id: str | None = ...,
        logprobs: _Iterable[TokenLogprob | _Mapping] | None = ...,
        index: int | None = ...,
    ) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool | None = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: str | None = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = (
        "alive",
        "cached_blocks",
        "draining",
        "free_blocks",
        "hit_rate",
        "live_blocks",
        "migrations_out",
        "node_id",
        "node_ip",
        "num_running",
        "num_waiting",
        "peak_live_blocks",
        "pool",
        "prefix_hit_tokens",
        "prefix_query_tokens",
        "requests_routed",
        "resident_adapters",
        "total_blocks",
        "worker_id",
    )
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    alive: bool
    total_blocks: int
    free_blocks: int
    live_blocks: int
    cached_blocks: int
    peak_live_blocks: int
    num_running: int
    num_waiting: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    hit_rate: float
    requests_routed: int
    node_id: str
    migrations_out: int
    draining: bool
    node_ip: str
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        worker_id: str | None = ...,
        pool: str | None = ...,
        alive: bool | None = ...,
        total_blocks: int | None = ...,
        free_blocks: int | None = ...,
        live_blocks: int | None = ...,
        cached_blocks: int | None = ...,
        peak_live_blocks: int | None = ...,
        num_running: int | None = ...,
        num_waiting: int | None = ...,
        prefix_query_tokens: int | None = ...,
        prefix_hit_tokens: int | None = ...,
        hit_rate: float | None = ...,
        requests_routed: int | None = ...,
        node_id: str | None = ...,
        migrations_out: int | None = ...,
        draining: bool | None = ...,
        node_ip: str | None = ...,
        resident_adapters: _Iterable[str] | None = ...,
    ) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = (
        "cached_blocks",
        "free_blocks",
        "hit_rate",
        "live_blocks",
        "live_workers",
        "migrations",
        "model",
        "name",
        "num_running",
        "num_waiting",
        "peak_live_blocks",
        "router_policy",
        "scale_reason",
        "target_workers",
        "total_blocks",
        "workers",
    )
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTER_POLICY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SCALE_REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    router_policy: str
    total_blocks: int
    free_blocks: int
    live_blocks: int
    cached_blocks: int
    peak_live_blocks: int
    num_running: int
    num_waiting: int
    hit_rate: float
    live_workers: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    migrations: int
    target_workers: int
    scale_reason: str
    def __init__(
        self,
        name: str | None = ...,
        model: str | None = ...,
        router_policy: str | None = ...,
        total_blocks: int | None = ...,
        free_blocks: int | None = ...,
        live_blocks: int | None = ...,
        cached_blocks: int | None = ...,
        peak_live_blocks: int | None = ...,
        num_running: int | None = ...,
        num_waiting: int | None = ...,
        hit_rate: float | None = ...,
        live_workers: int | None = ...,
        workers: _Iterable[WorkerStatus | _Mapping] | None = ...,
        migrations: int | None = ...,
        target_workers: int | None = ...,
        scale_reason: str | None = ...,
    ) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Iterable[PoolStatus | _Mapping] | None = ...) -> None: ...
