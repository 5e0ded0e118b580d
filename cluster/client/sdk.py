"""Python clients of the duet front end: `DuetClient` (blocking) and `AsyncDuetClient` (asyncio).

    with DuetClient("127.0.0.1:50051") as client:
        for event in client.generate("Hello", max_tokens=32, temperature=0.0):
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)
        done = client.complete("Hello", max_tokens=32, seed=7)   # the whole stream, collected
        print(done.text, done.finish_reason, done.usage)

    async with AsyncDuetClient("127.0.0.1:50051") as client:
        async for event in client.generate("Hello"):
            ...

A generation yields `Delta` events and then exactly one `Result`; a failed call raises `DuetError`
carrying the gRPC status code (and, when the cluster sent one before the status, the `Result`
with the request's timeline). Sampling keyword arguments left at None take the server's defaults
(vLLM's). Leaving a `generate` loop early cancels the call, and the cluster aborts the request.

Deadlines: unary calls (abort, get_request, cluster_status, health) default to 30 s. A
generation's `timeout_s` is sent as the request's own timeout, and the call's gRPC deadline is
set a little later so that the cluster's orderly DEADLINE_EXCEEDED (with the timeline) arrives
first; without one, the client's `timeout_s` (if any) is the call's deadline, else there is none.

This module imports no router or worker code: only grpc, the generated stubs and the standard
library, so that applications can use it without the serving stack.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet_wire.v1 import client_pb2 as pb
from duet_wire.v1 import client_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_UNARY_TIMEOUT_S = 30.0
# The call's deadline trails the request's own timeout by this much (see the module docstring).
STREAM_DEADLINE_GRACE_S = 1.0
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Duet"].full_name
REQUEST_ID_METADATA_KEY = "duet-request-id"

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


class ClientConfigError(ValueError):
    """A client setting or argument that cannot be sent (the message names it)."""


class DuetError(Exception):
    """A call that ended with a non-OK gRPC status.

    `result` is the final message the cluster sent before the status, when it sent one (a
    request that failed after it was accepted: it carries the timeline and the instances).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        request_id: str | None = None,
        result: Result | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.result = result

    @property
    def unreachable(self) -> bool:
        """True when no connection to the front end could be made (nothing was sent)."""
        text = self.message.lower()
        return self.code == grpc.StatusCode.UNAVAILABLE and any(
            marker in text
            for marker in ("failed to connect", "connection refused", "dns resolution failed", "connect failed")
        )

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, **context: Any) -> DuetError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error), **context)


# ---- typed values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely candidates at its position."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """New tokens, in order, and the text they complete (never a split UTF-8 character)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class StateChange:
    """One timeline entry: a global state (or, with `instance_id`, that instance's local one)."""

    state: str
    time_s: float  # wall clock of the node that recorded it, seconds since the epoch
    instance_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class InstanceWork:
    """One instance's part in a request."""

    instance_id: str
    role: str  # "PREFILL", "GENERATION", "MIXED"
    phase: str  # "prefill", "generation", "mixed", "recompute"
    attempt: int = 1


@dataclass(frozen=True)
class Result:
    """The end of a generation (the last event of a successful stream)."""

    request_id: str
    finish_reason: str | None  # "stop", "length", "abort" (vLLM's strings)
    stop_reason: int | str | None  # the stop token id or stop string, when one ended it
    usage: Usage
    timeline: tuple[StateChange, ...]
    instances: tuple[InstanceWork, ...]


GenerateEvent = Delta | Result


@dataclass(frozen=True)
class Completion:
    """A whole generation, collected from its stream. Times are measured by the client."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    usage: Usage
    timeline: tuple[StateChange, ...]
    instances: tuple[InstanceWork, ...]
    logprobs: tuple[TokenLogprob, ...]
    ttft_s: float | None  # call start to the first token; None when no token came
    total_s: float


@dataclass(frozen=True)
class AbortResult:
    aborted: bool  # False: it had already ended
    state: str  # its state when the abort arrived


@dataclass(frozen=True)
class RequestStatus:
    request_id: str
    client_request_id: str | None
    state: str
    result: Result | None
    timeline: tuple[StateChange, ...]
    instances: tuple[InstanceWork, ...]
    error: str


@dataclass(frozen=True)
class InstanceStatus:
    instance_id: str
    role: str  # "PREFILL", "GENERATION", "MIXED" (or "UNSPECIFIED")
    address: str
    health: str  # "HEALTHY", "DEGRADED", "UNHEALTHY", "DRAINING" (or "UNSPECIFIED")
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    queued_requests: int
    running_requests: int
    active_transfers: int
    last_report_s: float | None  # None when it never reported


@dataclass(frozen=True)
class ClusterStatus:
    instances: tuple[InstanceStatus, ...]
    queue_depth: int
    requests_by_state: Mapping[str, int]
    requests_by_outcome: Mapping[str, int]
    fallbacks: tuple[str, ...]
    max_recovery_attempts: int
    placement_policy: str
    timestamp_s: float
    model: ModelStatus | None = None


@dataclass(frozen=True)
class ModelStatus:
    """What the cluster serves: checkpoint ("built-in" for the built-in model), architecture, the
    dtype it computes in, its context length and the KV capacity of its smallest instance (tokens)."""

    name: str
    architecture: str
    dtype: str
    max_model_len: int
    kv_capacity_tokens: int


@dataclass(frozen=True)
class ClientTls:
    """TLS towards the front end: the CA to verify it by (None: the system's roots) and, for mutual
    TLS, this client's certificate chain and key. A `worker.kv_transfer.tls.TlsConfig` works too."""

    root_certificates_pem: bytes | None = None
    certificate_chain_pem: bytes | None = None
    private_key_pem: bytes | None = None
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        for name in ("root_certificates_pem", "certificate_chain_pem", "private_key_pem"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, bytes) or b"-----BEGIN " not in value):
                raise ClientConfigError(f"{name}: must be PEM bytes")
        if (self.certificate_chain_pem is None) != (self.private_key_pem is None):
            raise ClientConfigError("certificate_chain_pem and private_key_pem: give both or neither")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates_pem,
            private_key=self.private_key_pem,
            certificate_chain=self.certificate_chain_pem,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name_override is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name_override)]


# ---- building requests ------------------------------------------------------------------------


def _duration(seconds: float) -> Duration:
    whole = int(seconds)
    return Duration(seconds=whole, nanos=int(round((seconds - whole) * 1e9)))


def _set(message: Any, field: str, value: Any) -> None:
    try:
        setattr(message, field, value)
    except (TypeError, ValueError) as error:
        raise ClientConfigError(f"{field}: cannot send {value!r} ({error})") from None


def build_generate_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
    *,
    max_tokens: int | None = 16,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    logprobs: int | None = None,
    min_tokens: int | None = None,
    skip_special_tokens: bool | None = None,
    client_request_id: str | None = None,
    timeout_s: float | None = None,
    priority: float | None = None,
) -> pb.GenerateRequest:
    """The wire request; None leaves a field unset (the server's default). Range checks are the
    server's: it names the offending field in INVALID_ARGUMENT."""
    request = pb.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(item, Mapping) for item in prompt):
        # A conversation: the server renders it with the served model's chat template.
        for index, message in enumerate(prompt):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ClientConfigError(f"prompt[{index}]: a chat message needs a str role and a str content")
            request.messages.messages.add(role=role, content=content)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        try:
            request.token_ids.ids.extend(prompt)
        except (TypeError, ValueError) as error:
            raise ClientConfigError(f"prompt: token ids must be non-negative ints ({error})") from None
        request.token_ids.SetInParent()  # an empty list is still "token ids given"
    else:
        raise ClientConfigError(
            f"prompt: must be a str, a sequence of token ids or of chat messages, got {type(prompt).__name__}"
        )
    sampling = request.sampling
    optional = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
        "logprobs": logprobs,
        "min_tokens": min_tokens,
        "skip_special_tokens": skip_special_tokens,
    }
    for field, value in optional.items():
        if value is not None:
            _set(sampling, field, value)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    try:
        sampling.stop.extend(stops)
        sampling.stop_token_ids.extend(stop_token_ids or ())
    except (TypeError, ValueError) as error:
        raise ClientConfigError(f"stop / stop_token_ids: cannot send ({error})") from None
    _set(sampling, "ignore_eos", ignore_eos)
    _set(sampling, "include_stop_str_in_output", include_stop_str_in_output)
    if client_request_id is not None:
        _set(request, "client_request_id", client_request_id)
    if timeout_s is not None:
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ClientConfigError(f"timeout_s: must be a positive number, got {timeout_s!r}")
        request.timeout.CopyFrom(_duration(float(timeout_s)))
    if priority is not None:
        _set(request, "priority", priority)
    return request


# ---- reading responses ------------------------------------------------------------------------


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    try:
        return enum_type.Name(value).removeprefix(prefix)
    except ValueError:  # a value from a newer server
        return f"UNKNOWN({value})"


def _time_s(stamp: Any) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def delta_from_proto(request_id: str, delta: pb.TokenDelta) -> Delta:
    return Delta(
        request_id=request_id,
        token_ids=tuple(delta.token_ids),
        text=delta.text,
        logprobs=tuple(
            TokenLogprob(
                token_id=entry.token_id,
                logprob=entry.logprob,
                top=tuple(TopLogprob(top.token_id, top.logprob, top.text) for top in entry.top),
            )
            for entry in delta.logprobs
        ),
    )


def timeline_from_proto(events: Any) -> tuple[StateChange, ...]:
    return tuple(StateChange(e.state, _time_s(e.timestamp), e.instance_id, e.detail) for e in events)


def instances_from_proto(uses: Any) -> tuple[InstanceWork, ...]:
    return tuple(
        InstanceWork(u.instance_id, _enum_name(pb.InstanceRole, u.role, "INSTANCE_ROLE_"), u.phase, u.attempt)
        for u in uses
    )


def result_from_proto(request_id: str, result: pb.GenerateResult) -> Result:
    kind = result.WhichOneof("stop_reason")
    stop_reason: int | str | None = None if kind is None else getattr(result, kind)
    return Result(
        request_id=request_id,
        finish_reason=_FINISH_REASONS.get(result.finish_reason),
        stop_reason=stop_reason,
        usage=Usage(result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens),
        timeline=timeline_from_proto(result.timeline),
        instances=instances_from_proto(result.instances),
    )


def request_status_from_proto(response: pb.GetRequestResponse) -> RequestStatus:
    return RequestStatus(
        request_id=response.request_id,
        client_request_id=response.client_request_id if response.HasField("client_request_id") else None,
        state=response.state,
        result=result_from_proto(response.request_id, response.result) if response.HasField("result") else None,
        timeline=timeline_from_proto(response.timeline),
        instances=instances_from_proto(response.instances),
        error=response.error,
    )


def cluster_status_from_proto(response: pb.ClusterStatusResponse) -> ClusterStatus:
    return ClusterStatus(
        instances=tuple(
            InstanceStatus(
                instance_id=i.instance_id,
                role=_enum_name(pb.InstanceRole, i.role, "INSTANCE_ROLE_"),
                address=i.address,
                health=_enum_name(pb.InstanceHealth, i.health, "INSTANCE_HEALTH_"),
                free_blocks=i.load.free_blocks,
                total_blocks=i.load.total_blocks,
                cached_blocks=i.load.cached_blocks,
                queued_requests=i.load.queued_requests,
                running_requests=i.load.running_requests,
                active_transfers=i.load.active_transfers,
                last_report_s=_time_s(i.last_report) if i.HasField("last_report") else None,
            )
            for i in response.instances
        ),
        queue_depth=response.queue_depth,
        requests_by_state=MappingProxyType(dict(sorted(response.requests_by_state.items()))),
        requests_by_outcome=MappingProxyType(dict(sorted(response.requests_by_outcome.items()))),
        fallbacks=tuple(response.fallbacks),
        max_recovery_attempts=response.max_recovery_attempts,
        placement_policy=response.placement_policy,
        timestamp_s=_time_s(response.timestamp),
        model=ModelStatus(
            name=response.model.name,
            architecture=response.model.architecture,
            dtype=response.model.dtype,
            max_model_len=response.model.max_model_len,
            kv_capacity_tokens=response.model.kv_capacity_tokens,
        ) if response.HasField("model") else None,
    )


class _StreamReader:
    """Turns GenerateResponse messages into events: deltas at once, the result only once the call
    ended OK (a result followed by an error status becomes part of the DuetError)."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.result: Result | None = None

    def read(self, response: pb.GenerateResponse) -> Delta | None:
        self.request_id = response.request_id
        kind = response.WhichOneof("event")
        if kind == "delta":
            return delta_from_proto(response.request_id, response.delta)
        if kind == "result":
            self.result = result_from_proto(response.request_id, response.result)
        return None  # a result, or an event kind from a newer server

    def error(self, error: grpc.RpcError) -> DuetError:
        return DuetError.from_rpc_error(error, request_id=self.request_id, result=self.result)

    def finish(self) -> Result:
        if self.result is None:
            raise DuetError(grpc.StatusCode.INTERNAL, "the stream ended without a result", request_id=self.request_id)
        return self.result


class _Collector:
    def __init__(self, started_s: float) -> None:
        self._started_s = started_s
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._ttft_s: float | None = None

    def add(self, event: GenerateEvent, now_s: float) -> Completion | None:
        if isinstance(event, Delta):
            if event.token_ids and self._ttft_s is None:
                self._ttft_s = now_s - self._started_s
            self._token_ids.extend(event.token_ids)
            self._text.append(event.text)
            self._logprobs.extend(event.logprobs)
            return None
        return Completion(
            request_id=event.request_id,
            token_ids=tuple(self._token_ids),
            text="".join(self._text),
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
            usage=event.usage,
            timeline=event.timeline,
            instances=event.instances,
            logprobs=tuple(self._logprobs),
            ttft_s=self._ttft_s,
            total_s=now_s - self._started_s,
        )


# ---- the clients ------------------------------------------------------------------------------


class _Settings:
    """What both clients share: target, credentials, metadata and deadlines."""

    def __init__(
        self,
        target: str,
        token: str | None,
        tls: Any,
        timeout_s: float | None,
        max_message_bytes: int,
    ) -> None:
        if not isinstance(target, str) or not target.strip():
            raise ClientConfigError(f"target: must be HOST:PORT, got {target!r}")
        if token is not None and (
            not isinstance(token, str) or not token or not token.isascii() or not token.isprintable() or " " in token
        ):
            raise ClientConfigError("token: must be printable ASCII without spaces")
        if tls is not None and not (hasattr(tls, "channel_credentials") and hasattr(tls, "channel_options")):
            raise ClientConfigError(f"tls: must be a ClientTls or a TlsConfig, got {type(tls).__name__}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ClientConfigError(f"timeout_s: must be a positive number or None, got {timeout_s!r}")
        self.target = target
        self.tls = tls
        self.timeout_s = timeout_s
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls is not None:
            self.options.extend(tls.channel_options())

    @property
    def unary_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else DEFAULT_UNARY_TIMEOUT_S

    def stream_deadline_s(self, request: pb.GenerateRequest) -> float | None:
        if request.HasField("timeout"):
            return request.timeout.seconds + request.timeout.nanos / 1e9 + STREAM_DEADLINE_GRACE_S
        return self.timeout_s


def _ref(request_id: str | None, client_request_id: str | None) -> pb.RequestRef:
    if (request_id is None) == (client_request_id is None):
        raise ClientConfigError("give exactly one of request_id / client_request_id")
    if request_id is not None:
        return pb.RequestRef(request_id=request_id)
    return pb.RequestRef(client_request_id=client_request_id)


class DuetClient:
    """A blocking client over one gRPC channel (thread-safe, as grpc channels are)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: ClientTls | Any | None = None,
        timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._settings = _Settings(target, token, tls, timeout_s, max_message_bytes)
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=self._settings.options)
        else:
            self._channel = grpc.secure_channel(target, tls.channel_credentials(), options=self._settings.options)
        self._stub = pb_grpc.DuetStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        return self._settings.target

    def generate_raw(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The wire messages of one Generate call; raises DuetError on a non-OK status."""
        call = self._stub.Generate(
            request, timeout=self._settings.stream_deadline_s(request), metadata=self._settings.metadata
        )
        try:
            yield from call
        except grpc.RpcError as error:
            raise DuetError.from_rpc_error(error) from None
        finally:
            call.cancel()  # no-op once the call ended; stops the request when the caller leaves early

    def generate(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], **kwargs: Any) -> Iterator[GenerateEvent]:
        """Deltas, then one Result. Keyword arguments are those of `build_generate_request`."""
        return self.generate_request(build_generate_request(prompt, **kwargs))

    def generate_request(self, request: pb.GenerateRequest) -> Iterator[GenerateEvent]:
        """`generate` for a request built already (`build_generate_request`)."""
        reader = _StreamReader()
        call = self._stub.Generate(
            request, timeout=self._settings.stream_deadline_s(request), metadata=self._settings.metadata
        )
        try:
            for response in call:
                delta = reader.read(response)
                if delta is not None:
                    yield delta
        except grpc.RpcError as error:
            raise reader.error(error) from None
        finally:
            call.cancel()
        yield reader.finish()

    def complete(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], **kwargs: Any) -> Completion:
        """The whole generation, collected."""
        collector = _Collector(time.monotonic())
        with contextlib.closing(self.generate(prompt, **kwargs)) as events:
            for event in events:
                completion = collector.add(event, time.monotonic())
                if completion is not None:
                    return completion
        raise DuetError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    def abort(self, request_id: str | None = None, *, client_request_id: str | None = None) -> AbortResult:
        response = self._unary(self._stub.Abort, pb.AbortRequest(request=_ref(request_id, client_request_id)))
        return AbortResult(aborted=response.aborted, state=response.state)

    def get_request_raw(self, request_id: str | None = None, *, client_request_id: str | None = None) -> pb.GetRequestResponse:
        return self._unary(self._stub.GetRequest, pb.GetRequestRequest(request=_ref(request_id, client_request_id)))

    def get_request(self, request_id: str | None = None, *, client_request_id: str | None = None) -> RequestStatus:
        return request_status_from_proto(self.get_request_raw(request_id, client_request_id=client_request_id))

    def cluster_status_raw(self) -> pb.ClusterStatusResponse:
        return self._unary(self._stub.ClusterStatus, pb.ClusterStatusRequest())

    def cluster_status(self) -> ClusterStatus:
        return cluster_status_from_proto(self.cluster_status_raw())

    def health(self) -> bool:
        """True when the front end reports SERVING; raises DuetError when it cannot be reached."""
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._settings.unary_timeout_s, metadata=self._settings.metadata)
        except grpc.RpcError as error:
            raise DuetError.from_rpc_error(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DuetClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncDuetClient:
    """The same API on grpc.aio. Create it inside the event loop it will be used on."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: ClientTls | Any | None = None,
        timeout_s: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._settings = _Settings(target, token, tls, timeout_s, max_message_bytes)
        if tls is None:
            self._channel = grpc.aio.insecure_channel(target, options=self._settings.options)
        else:
            self._channel = grpc.aio.secure_channel(target, tls.channel_credentials(), options=self._settings.options)
        self._stub = pb_grpc.DuetStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        return self._settings.target

    async def generate_raw(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        call = self._stub.Generate(
            request, timeout=self._settings.stream_deadline_s(request), metadata=self._settings.metadata
        )
        try:
            async for response in call:
                yield response
        except grpc.RpcError as error:
            raise DuetError.from_rpc_error(error) from None
        finally:
            call.cancel()

    def generate(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], **kwargs: Any) -> AsyncIterator[GenerateEvent]:
        """Deltas, then one Result. Leaving early: use `contextlib.aclosing` to cancel at once (an
        abandoned generator is closed, and the call cancelled, when the loop finalizes it)."""
        return self.generate_request(build_generate_request(prompt, **kwargs))

    async def generate_request(self, request: pb.GenerateRequest) -> AsyncIterator[GenerateEvent]:
        reader = _StreamReader()
        call = self._stub.Generate(
            request, timeout=self._settings.stream_deadline_s(request), metadata=self._settings.metadata
        )
        try:
            async for response in call:
                delta = reader.read(response)
                if delta is not None:
                    yield delta
        except grpc.RpcError as error:
            raise reader.error(error) from None
        finally:
            call.cancel()
        yield reader.finish()

    async def complete(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], **kwargs: Any) -> Completion:
        collector = _Collector(time.monotonic())
        async with contextlib.aclosing(self.generate(prompt, **kwargs)) as events:
            async for event in events:
                completion = collector.add(event, time.monotonic())
                if completion is not None:
                    return completion
        raise DuetError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    async def abort(self, request_id: str | None = None, *, client_request_id: str | None = None) -> AbortResult:
        response = await self._unary(self._stub.Abort, pb.AbortRequest(request=_ref(request_id, client_request_id)))
        return AbortResult(aborted=response.aborted, state=response.state)

    async def get_request_raw(
        self, request_id: str | None = None, *, client_request_id: str | None = None
    ) -> pb.GetRequestResponse:
        return await self._unary(self._stub.GetRequest, pb.GetRequestRequest(request=_ref(request_id, client_request_id)))

    async def get_request(self, request_id: str | None = None, *, client_request_id: str | None = None) -> RequestStatus:
        return request_status_from_proto(await self.get_request_raw(request_id, client_request_id=client_request_id))

    async def cluster_status_raw(self) -> pb.ClusterStatusResponse:
        return await self._unary(self._stub.ClusterStatus, pb.ClusterStatusRequest())

    async def cluster_status(self) -> ClusterStatus:
        return cluster_status_from_proto(await self.cluster_status_raw())

    async def health(self) -> bool:
        response = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._settings.unary_timeout_s, metadata=self._settings.metadata)
        except grpc.RpcError as error:
            raise DuetError.from_rpc_error(error) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncDuetClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
