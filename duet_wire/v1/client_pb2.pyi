import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class InstanceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_ROLE_UNSPECIFIED: _ClassVar[InstanceRole]
    INSTANCE_ROLE_PREFILL: _ClassVar[InstanceRole]
    INSTANCE_ROLE_GENERATION: _ClassVar[InstanceRole]
    INSTANCE_ROLE_MIXED: _ClassVar[InstanceRole]

class InstanceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_HEALTH_UNSPECIFIED: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_HEALTHY: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_DEGRADED: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_UNHEALTHY: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_DRAINING: _ClassVar[InstanceHealth]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
INSTANCE_ROLE_UNSPECIFIED: InstanceRole
INSTANCE_ROLE_PREFILL: InstanceRole
INSTANCE_ROLE_GENERATION: InstanceRole
INSTANCE_ROLE_MIXED: InstanceRole
INSTANCE_HEALTH_UNSPECIFIED: InstanceHealth
INSTANCE_HEALTH_HEALTHY: InstanceHealth
INSTANCE_HEALTH_DEGRADED: InstanceHealth
INSTANCE_HEALTH_UNHEALTHY: InstanceHealth
INSTANCE_HEALTH_DRAINING: InstanceHealth

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "min_tokens", "skip_special_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    min_tokens: int
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., include_stop_str_in_output: bool = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., skip_special_tokens: bool = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: bool = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "sampling", "client_request_id", "timeout", "priority")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    client_request_id: str
    timeout: _duration_pb2.Duration
    priority: float
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., client_request_id: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., priority: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StateEvent(_message.Message):
    __slots__ = ("state", "timestamp", "instance_id", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: str
    timestamp: _timestamp_pb2.Timestamp
    instance_id: str
    detail: str
    def __init__(self, state: _Optional[str] = ..., timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., instance_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class InstanceUse(_message.Message):
    __slots__ = ("instance_id", "role", "phase", "attempt")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: InstanceRole
    phase: str
    attempt: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[InstanceRole, str]] = ..., phase: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("finish_reason", "stop_string", "stop_token_id", "usage", "timeline", "instances")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    usage: Usage
    timeline: _containers.RepeatedCompositeFieldContainer[StateEvent]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceUse]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timeline: _Optional[_Iterable[_Union[StateEvent, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[InstanceUse, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "result")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    result: GenerateResult
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("request_id", "client_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: RequestRef
    def __init__(self, request: _Optional[_Union[RequestRef, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted", "state")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    state: str
    def __init__(self, aborted: bool = ..., state: _Optional[str] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: RequestRef
    def __init__(self, request: _Optional[_Union[RequestRef, _Mapping]] = ...) -> None: ...

class GetRequestResponse(_message.Message):
    __slots__ = ("request_id", "client_request_id", "state", "result", "timeline", "instances", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_request_id: str
    state: str
    result: GenerateResult
    timeline: _containers.RepeatedCompositeFieldContainer[StateEvent]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceUse]
    error: str
    def __init__(self, request_id: _Optional[str] = ..., client_request_id: _Optional[str] = ..., state: _Optional[str] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ..., timeline: _Optional[_Iterable[_Union[StateEvent, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[InstanceUse, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("free_blocks", "total_blocks", "cached_blocks", "queued_requests", "running_requests", "active_transfers")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    queued_requests: int
    running_requests: int
    active_transfers: int
    def __init__(self, free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., active_transfers: _Optional[int] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "role", "address", "health", "load", "last_report")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: InstanceRole
    address: str
    health: InstanceHealth
    load: InstanceLoad
    last_report: _timestamp_pb2.Timestamp
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ..., health: _Optional[_Union[InstanceHealth, str]] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., last_report: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("instances", "queue_depth", "requests_by_state", "requests_by_outcome", "fallbacks", "max_recovery_attempts", "placement_policy", "timestamp", "model")
    class RequestsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RequestsByOutcomeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECOVERY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    queue_depth: int
    requests_by_state: _containers.ScalarMap[str, int]
    requests_by_outcome: _containers.ScalarMap[str, int]
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    max_recovery_attempts: int
    placement_policy: str
    timestamp: _timestamp_pb2.Timestamp
    model: ModelStatus
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., requests_by_state: _Optional[_Mapping[str, int]] = ..., requests_by_outcome: _Optional[_Mapping[str, int]] = ..., fallbacks: _Optional[_Iterable[str]] = ..., max_recovery_attempts: _Optional[int] = ..., placement_policy: _Optional[str] = ..., timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., model: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "architecture", "dtype", "max_model_len", "kv_capacity_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    dtype: str
    max_model_len: int
    kv_capacity_tokens: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...
