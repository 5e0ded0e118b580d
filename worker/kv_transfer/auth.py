"""Bearer-token authentication of gRPC calls: a server interceptor and the matching client metadata.

Used by the KV transfer server (the cluster token) and reusable by any other gRPC server of the
project (the cluster front end's bearer tokens). Tokens are compared in constant time; a call
without a valid token ends with UNAUTHENTICATED before its handler runs and before any request
message is parsed.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable

import grpc

logger = logging.getLogger(__name__)

AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "
MIN_TOKEN_CHARS = 16
_NOT_PARSED = object()


class TokenError(ValueError):
    """A token that is too short or not printable ASCII."""


def check_token(token: object) -> str:
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
        raise TokenError(f"token must be printable ASCII of at least {MIN_TOKEN_CHARS} characters")
    if token != token.strip():
        raise TokenError("token must not start or end with whitespace")
    return token


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a client with `token`."""
    return ((AUTHORIZATION_METADATA_KEY, BEARER_PREFIX + token),)


def _deny(context: grpc.ServicerContext, detail: str) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)


def _denying_handler(handler: grpc.RpcMethodHandler, detail: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that rejects the call without reading it."""

    def unary_behavior(_request: object, context: grpc.ServicerContext) -> None:
        _deny(context, detail)

    # Requests are not parsed for an unauthenticated caller (grpc takes None for a parse failure,
    # hence a placeholder).
    def ignore(_raw: bytes) -> object:
        return _NOT_PARSED

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(unary_behavior, request_deserializer=ignore)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_behavior, request_deserializer=ignore)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary_behavior, request_deserializer=ignore)
    return grpc.unary_unary_rpc_method_handler(unary_behavior, request_deserializer=ignore)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Admits a call only if its `authorization` metadata is `Bearer <one of tokens>`.

    `exempt_methods` are full method names (e.g. "/grpc.health.v1.Health/Check") served without a token.
    """

    def __init__(self, tokens: Iterable[str], *, exempt_methods: Iterable[str] = ()) -> None:
        self._tokens = tuple(check_token(token).encode("ascii") for token in tokens)
        if not self._tokens:
            raise TokenError("at least one token is required")
        self._exempt = frozenset(exempt_methods)
        self._lock = threading.Lock()
        self._rejected_calls = 0

    @property
    def rejected_calls(self) -> int:
        """Calls refused so far (logged at debug level only, so that a flood cannot fill the logs)."""
        with self._lock:
            return self._rejected_calls

    def _authorized(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        presented: list[bytes] = []
        for key, value in metadata or ():
            if key == AUTHORIZATION_METADATA_KEY:
                raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                presented.append(raw)
        if len(presented) != 1 or not presented[0].startswith(BEARER_PREFIX.encode("ascii")):
            return False
        candidate = presented[0][len(BEARER_PREFIX) :]
        # Compare against every token so the time taken does not reveal which one (if any) matched.
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(candidate, token)
        return matched

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        with self._lock:
            self._rejected_calls += 1
        logger.debug("rejected unauthenticated call to %s", handler_call_details.method)
        return _denying_handler(handler, "missing or invalid bearer token")
