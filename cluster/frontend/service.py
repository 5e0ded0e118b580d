"""The cluster's gRPC front end: serves `duet_wire.v1.Duet` on a grpc.aio server in front of a `RouterAPI`.

    server = FrontendServer(router, host="127.0.0.1", port=50051, tokens=["..."])
    port = await server.start()          # on the router's event loop
    ...
    await server.set_serving(False)      # draining: health reports NOT_SERVING
    await server.stop(grace_s=10.0)

Besides Duet it serves the standard `grpc.health.v1.Health` service (SERVING for "" and for
"duet_wire.v1.Duet" until `set_serving(False)`) and server reflection, both
`grpc.reflection.v1` (what newer grpcurl and Postman ask for) and `grpc.reflection.v1alpha`, so
grpcurl and grpc_health_probe work against it.

Edge rules (docs/architecture.md, "Invariants"): every Generate request is parsed and validated
here, before the router is called, and bad input ends with INVALID_ARGUMENT naming the field by its
protobuf path ("sampling.top_p: must be in (0, 1], got 1.5"). Requests that fail to parse are
INVALID_ARGUMENT too. Client errors (bad input, unknown ids, failed authentication) never reach the
router, so they can never count against an instance's health. Messages larger than
`max_message_bytes` are refused by gRPC itself with RESOURCE_EXHAUSTED.

Unknown protobuf fields are ignored, as protobuf does: a newer client that sets a field this
server does not know gets the behaviour of the fields it does know (proto3 forward
compatibility), not an error.

Streaming: token events become `TokenDelta` messages as they come; token events that pile up
while a message is being written go out together as one delta (never delayed, only merged), so
a flood of tokens costs writes, not one gRPC message per token. The result is always a message
of its own, and the last one.

Deadlines and cancellation: the call's gRPC deadline becomes the request's timeout (the smaller
of it and the request's own `timeout`). When the client cancels, disconnects or its deadline
passes, the handler is cancelled and the front end calls `router.abort(request_id)`: no request
keeps running for a client that is gone. The request id is also sent as initial metadata
(`duet-request-id`) so that a client can abort before the first token arrives.

Authentication (optional): `authorization: Bearer <token>` metadata, compared in constant time
against every configured token. Missing, malformed or not accepted -> UNAUTHENTICATED (the HTTP
front end answers 401 for all three). The health service is exempt (load balancers probe it without
credentials); reflection is not. TLS is optional (`TlsConfig`; set `require_client_auth=False`
for server-only TLS).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from cluster.frontend.convert import (
    ChatEncoder,
    ModelLimits,
    RequestValidationError,
    client_request_from_proto,
    cluster_view_to_proto,
    final_event_to_proto,
    request_ref_from_proto,
    request_view_to_proto,
    token_event_to_proto,
)
from cluster.router.api import (
    ErrorKind,
    FinalEvent,
    RequestEvent,
    RequestHandle,
    RouterAPI,
    RouterError,
    TokenEvent,
)
from cluster.shutdown import STOP_TIMEOUT_S, bounded
from duet_wire.v1 import client_pb2 as pb
from worker.kv_transfer.auth import AUTHORIZATION_METADATA_KEY, check_token
from worker.kv_transfer.tls import TlsConfig
from worker.sampler_types import SampleLogprobs

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Duet"].full_name  # "duet_wire.v1.Duet"
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REQUEST_ID_METADATA_KEY = "duet-request-id"
DEFAULT_PORT = 50051
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MIN_MESSAGE_BYTES = 1024
# At most this many tokens go out in one delta when token events pile up behind a slow write.
MAX_COALESCED_TOKENS = 1024
# Events read ahead of the writer at most; beyond that the router's queue takes the backlog.
MAX_QUEUED_EVENTS = 256
# How long stop() waits for the aborts of requests whose clients went away.
ORPHAN_ABORT_WAIT_S = 5.0


class FrontendError(RuntimeError):
    """The front end could not start (bad settings, port taken) or was used out of order."""


def status_code_for(kind: ErrorKind) -> grpc.StatusCode:
    """ErrorKind names are gRPC status names by construction."""
    return grpc.StatusCode[kind.value]


def _router_error_detail(error: RouterError) -> str:
    return f"{error.field}: {error.message}" if error.field else error.message


# ---- authentication ---------------------------------------------------------------------------


class _AuthVerdict:
    """Why a call was refused (None means admitted)."""

    MALFORMED = (grpc.StatusCode.UNAUTHENTICATED, "missing or malformed bearer token")
    # UNAUTHENTICATED, not PERMISSION_DENIED: a wrong token is a failed authentication (the
    # credentials are not valid), as the HTTP front end's 401 says; duet has no per-caller permissions.
    REJECTED = (grpc.StatusCode.UNAUTHENTICATED, "bearer token not accepted")


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call whose `authorization` metadata is `Bearer <one of tokens>`; exempt methods pass."""

    def __init__(self, tokens: Iterable[str], *, exempt_prefixes: Iterable[str] = ()) -> None:
        self._tokens = tuple(check_token(token).encode("ascii") for token in tokens)
        if not self._tokens:
            raise FrontendError("tokens: at least one token is required for bearer authentication")
        self._exempt_prefixes = tuple(exempt_prefixes)

    def verdict(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[grpc.StatusCode, str] | None:
        presented = [value for key, value in (metadata or ()) if key == AUTHORIZATION_METADATA_KEY]
        if len(presented) != 1:
            return _AuthVerdict.MALFORMED
        raw = presented[0]
        value = raw if isinstance(raw, bytes) else raw.encode("utf-8", "replace")
        scheme, _, credential = value.partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the token is not.
        if scheme.lower() != b"bearer" or not _printable_token(credential):
            return _AuthVerdict.MALFORMED
        # Compare with every token so that the time taken does not say which one (if any) matched.
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(credential, token)
        return None if matched else _AuthVerdict.REJECTED

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(self._exempt_prefixes):
            return await continuation(handler_call_details)
        refusal = self.verdict(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if refusal is None or handler is None:
            return handler
        logger.debug("refused call to %s: %s", handler_call_details.method, refusal[1])
        return _refusing_handler(handler, *refusal)


def _printable_token(value: bytes) -> bool:
    return bool(value) and value.isascii() and value.decode("ascii").isprintable() and b" " not in value


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, detail: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that refuses the call without parsing its request."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(code, detail)

    def unparsed(_raw: bytes) -> bytes:
        return b""

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=unparsed)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=unparsed)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=unparsed)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=unparsed)


# ---- the Duet service -------------------------------------------------------------------------


def _raw(data: bytes) -> bytes:
    return data


async def _parse(message_type: type[Message], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    # Parsed here rather than by grpc so that a malformed request is INVALID_ARGUMENT, not INTERNAL.
    try:
        return message_type.FromString(raw)
    except DecodeError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {message_type.__name__} ({error})")


class _End:
    """Marks the end of a request's event stream in the reader's queue."""


class _CoalescingReader:
    """Reads a request's events on a task of its own, so that token events that arrive while a
    message is being written go out together as one delta.

    Nothing is delayed: when the client keeps up, each token is written as it comes. When it does
    not (or the loop is busy), the front end's cost follows the number of writes, not of tokens,
    which is what a gRPC stream costs most per message.
    """

    def __init__(self, events: AsyncIterator[RequestEvent]) -> None:
        # Bounded, so that a client that stops reading stalls the router's own (bounded) event
        # queue, which is how the router notices and aborts the request.
        self._queue: asyncio.Queue[RequestEvent | Exception | _End] = asyncio.Queue(MAX_QUEUED_EVENTS)
        self._held: RequestEvent | Exception | _End | None = None
        self._task = asyncio.get_running_loop().create_task(self._read(events))

    async def _read(self, events: AsyncIterator[RequestEvent]) -> None:
        try:
            async for event in events:
                await self._queue.put(event)
        except Exception as error:  # handed to the writer, which raises it in the handler
            await self._queue.put(error)
        await self._queue.put(_End())

    async def next(self) -> RequestEvent | None:
        """The next event, with the token events queued right behind it merged in; None at the end."""
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self._queue.get()
        if isinstance(item, TokenEvent):
            merged = [item]
            tokens = len(item.token_ids)
            while tokens < MAX_COALESCED_TOKENS and not self._queue.empty():
                following = self._queue.get_nowait()
                if not isinstance(following, TokenEvent):
                    self._held = following
                    break
                merged.append(following)
                tokens += len(following.token_ids)
            return merge_token_events(merged)
        if isinstance(item, Exception):
            raise item
        if isinstance(item, _End):
            return None
        return item

    def close(self) -> None:
        """Stop reading (the router's generator is closed by the cancellation)."""
        self._task.cancel()


def merge_token_events(events: Sequence[TokenEvent]) -> TokenEvent:
    """Consecutive token events as one; logprobs stay one entry per token when any event has them."""
    if len(events) == 1:
        return events[0]
    logprobs: tuple[SampleLogprobs | None, ...] = ()
    if any(event.logprobs for event in events):
        logprobs = tuple(
            entry
            for event in events
            for entry in (event.logprobs if event.logprobs else (None,) * len(event.token_ids))
        )
    return TokenEvent(
        token_ids=tuple(token for event in events for token in event.token_ids),
        text="".join(event.text for event in events),
        logprobs=logprobs,
    )


class DuetService:
    """The four Duet RPCs on top of a router. Holds no request state besides orphan aborts in flight."""

    def __init__(self, router: RouterAPI, chat: ChatEncoder | None = None) -> None:
        self._router = router
        self._chat = chat
        self._orphan_aborts: set[asyncio.Task[None]] = set()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate, request_deserializer=_raw, response_serializer=pb.GenerateResponse.SerializeToString
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(
                    self.abort, request_deserializer=_raw, response_serializer=pb.AbortResponse.SerializeToString
                ),
                "GetRequest": grpc.unary_unary_rpc_method_handler(
                    self.get_request,
                    request_deserializer=_raw,
                    response_serializer=pb.GetRequestResponse.SerializeToString,
                ),
                "ClusterStatus": grpc.unary_unary_rpc_method_handler(
                    self.cluster_status,
                    request_deserializer=_raw,
                    response_serializer=pb.ClusterStatusResponse.SerializeToString,
                ),
            },
        )

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        request = await _parse(pb.GenerateRequest, raw, context)
        # Read per call: the router learns the model's limits when its instances register.
        limits = ModelLimits(vocab_size=self._router.vocab_size, max_seq_len=self._router.max_seq_len)
        try:
            client_request = client_request_from_proto(
                request,
                limits,
                self._router.tokenize,
                call_time_remaining_s=context.time_remaining(),
                chat=self._chat,
            )
        except RequestValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if client_request.timeout_s is not None and client_request.timeout_s <= 0.0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before the request started")

        handle = await self._submit(client_request, context)
        request_id = handle.request_id
        finished = False
        events = _CoalescingReader(handle.events())
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, request_id),))
            while (event := await events.next()) is not None:
                if isinstance(event, TokenEvent):
                    await context.write(token_event_to_proto(request_id, event))
                    continue
                if not isinstance(event, FinalEvent):
                    raise TypeError(f"router yielded {type(event).__name__}, expected TokenEvent or FinalEvent")
                finished = True
                await context.write(final_event_to_proto(request_id, event))
                if event.error_kind is not None:
                    await context.abort(status_code_for(event.error_kind), event.error_message or event.error_kind.value)
                return
        except RouterError as error:
            finished = True  # the router ended it itself
            await context.abort(status_code_for(error.kind), _router_error_detail(error))
        finally:
            events.close()
            if not finished:
                self._abort_orphan(request_id)
        logger.error("request %s: the router's event stream ended without a final event", request_id)
        await context.abort(grpc.StatusCode.INTERNAL, "the request ended without a result")

    async def _submit(self, client_request: Any, context: grpc.aio.ServicerContext) -> RequestHandle:
        # Shielded: if the client goes away while the router is admitting the request, the request
        # is aborted as soon as it has an id instead of running for nobody.
        submit = asyncio.ensure_future(self._router.submit(client_request))
        try:
            return await asyncio.shield(submit)
        except RouterError as error:
            await context.abort(status_code_for(error.kind), _router_error_detail(error))
        except asyncio.CancelledError:
            submit.add_done_callback(self._abort_if_admitted)
            raise

    def _abort_if_admitted(self, submit: asyncio.Future[RequestHandle]) -> None:
        if not submit.cancelled() and submit.exception() is None:
            self._abort_orphan(submit.result().request_id)

    def _abort_orphan(self, request_id: str) -> None:
        # A task of its own: the handler is being cancelled and may be cancelled again at shutdown.
        task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
        self._orphan_aborts.add(task)
        task.add_done_callback(self._orphan_aborts.discard)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            aborted, state = await self._router.abort(request_id=request_id)
        except RouterError as error:
            # NOT_FOUND: it ended on its own meanwhile.
            logger.debug("abort of %s after its client left: %s", request_id, error)
            return
        logger.info("request %s aborted: its client went away (state %s, aborted=%s)", request_id, state, aborted)

    async def wait_for_orphan_aborts(self, timeout_s: float) -> None:
        if self._orphan_aborts:
            await asyncio.wait(set(self._orphan_aborts), timeout=timeout_s)

    async def abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        request = await _parse(pb.AbortRequest, raw, context)
        request_id, client_request_id = await self._ref(request, context)
        try:
            aborted, state = await self._router.abort(request_id=request_id, client_request_id=client_request_id)
        except RouterError as error:
            await context.abort(status_code_for(error.kind), _router_error_detail(error))
        return pb.AbortResponse(aborted=aborted, state=state)

    async def get_request(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetRequestResponse:
        request = await _parse(pb.GetRequestRequest, raw, context)
        request_id, client_request_id = await self._ref(request, context)
        try:
            view = self._router.get_request(request_id=request_id, client_request_id=client_request_id)
        except RouterError as error:
            await context.abort(status_code_for(error.kind), _router_error_detail(error))
        return request_view_to_proto(view)

    async def cluster_status(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ClusterStatusResponse:
        await _parse(pb.ClusterStatusRequest, raw, context)
        return cluster_view_to_proto(self._router.cluster_status())

    @staticmethod
    async def _ref(request: Any, context: grpc.aio.ServicerContext) -> tuple[str | None, str | None]:
        try:
            return request_ref_from_proto(request.request)
        except RequestValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


# ---- the server -------------------------------------------------------------------------------


class FrontendServer:
    """A grpc.aio server on the running event loop: Duet, health, reflection; optional auth and TLS."""

    def __init__(
        self,
        router: RouterAPI,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        tokens: Sequence[str] = (),
        tls: TlsConfig | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chat: ChatEncoder | None = None,
    ) -> None:
        check_listener(host, port, tokens, port_name="port")
        if not isinstance(max_message_bytes, int) or max_message_bytes < MIN_MESSAGE_BYTES:
            raise FrontendError(f"max_message_bytes: must be an int >= {MIN_MESSAGE_BYTES}, got {max_message_bytes!r}")
        if tls is not None and not isinstance(tls, TlsConfig):
            raise FrontendError(f"tls: must be a TlsConfig, got {type(tls).__name__}")
        self._host = host
        self._port = port
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._service = DuetService(router, chat)
        self._auth = (
            BearerAuthInterceptor(tokens, exempt_prefixes=(f"/{HEALTH_SERVICE_NAME}/",)) if tokens else None
        )
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._bound_port: int | None = None

    @property
    def port(self) -> int:
        if self._bound_port is None:
            raise FrontendError("the server is not started")
        return self._bound_port

    @property
    def address(self) -> str:
        return f"{host_for_address(self._host)}:{self.port}"

    async def start(self) -> int:
        """Bind, start serving and report SERVING; returns the bound port."""
        if self._server is not None:
            raise FrontendError("the server is already started")
        server = grpc.aio.server(
            interceptors=[self._auth] if self._auth is not None else None,
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
                # Without this a second server could share a port that is already in use.
                ("grpc.so_reuseport", 0),
            ],
        )
        server.add_generic_rpc_handlers((self._service.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        _enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), server)
        address = f"{host_for_address(self._host)}:{self._port}"
        try:
            if self._tls is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, self._tls.server_credentials())
        except RuntimeError as error:
            raise FrontendError(f"cannot bind {address}: {error}") from error
        if bound == 0:
            raise FrontendError(f"cannot bind {address}: address in use or not available")
        await server.start()
        self._server = server
        self._bound_port = bound
        await self.set_serving(True)
        # Debug only: the command that started the front end announces "serving on" once.
        logger.debug("front end serving on %s:%d%s", self._host, bound, " (TLS)" if self._tls else "")
        return bound

    async def set_serving(self, serving: bool) -> None:
        """Health reports SERVING or NOT_SERVING for "" and the Duet service (draining sets False)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING, then stop accepting calls; calls still running after `grace_s` are cancelled
        (and their requests aborted at the router)."""
        if self._server is None:
            return
        await bounded(self._health.enter_graceful_shutdown(), "the front end's health service")
        await bounded(self._server.stop(grace_s), "the gRPC front end's server stop", grace_s + STOP_TIMEOUT_S)
        await self._service.wait_for_orphan_aborts(ORPHAN_ABORT_WAIT_S)
        self._server = None
        logger.info("front end on %s:%s stopped", self._host, self._bound_port)


REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection under both names. grpcio-reflection ships only v1alpha; v1 is the same
    protocol (message for message, field for field) in another package, so one servicer answers
    both, v1 through a handler registered under its own name."""
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),))


def check_listener(host: object, port: object, tokens: object, *, port_name: str) -> None:
    """The settings every front end's listener is built from (gRPC here, HTTP in http.py)."""
    if not isinstance(host, str) or not host:
        raise FrontendError(f"host: must be a non-empty string, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise FrontendError(f"{port_name}: must be in [0, 65535] (0 picks a free port), got {port!r}")
    if isinstance(tokens, str):
        raise FrontendError("tokens: must be a sequence of tokens, not one string")


def host_for_address(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
