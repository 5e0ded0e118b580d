"""Why a KV transfer failed, and how each reason travels as a gRPC status.

A status code alone is ambiguous (several reasons share one), so the side that fails a call also
sets the trailing metadata key FAILURE_METADATA_KEY to the reason's name; `reason_from_grpc` prefers
that and falls back to the code's default reason.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

FAILURE_METADATA_KEY = "duet-transfer-failure"


class FailureReason(enum.Enum):
    """Why a transfer failed. Values equal the proto enum names without their prefix."""

    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
    RESERVATION_EXPIRED = "RESERVATION_EXPIRED"
    UNKNOWN_TRANSFER = "UNKNOWN_TRANSFER"
    INCOMPATIBLE = "INCOMPATIBLE"
    INCOMPLETE = "INCOMPLETE"
    CANCELLED = "CANCELLED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    INTERNAL = "INTERNAL"


# The status a receiver answers with for each reason (and a sender reports when it maps a local
# failure onto a status, e.g. for the router).
_CODE_BY_REASON: dict[FailureReason, grpc.StatusCode] = {
    FailureReason.CHECKSUM_MISMATCH: grpc.StatusCode.DATA_LOSS,
    FailureReason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureReason.PEER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    # The reservation is gone, like an unknown transfer; the metadata tells the two apart.
    FailureReason.RESERVATION_EXPIRED: grpc.StatusCode.NOT_FOUND,
    FailureReason.UNKNOWN_TRANSFER: grpc.StatusCode.NOT_FOUND,
    FailureReason.INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    # "Retry at a higher level" (a new transfer), which is what the router does.
    FailureReason.INCOMPLETE: grpc.StatusCode.ABORTED,
    FailureReason.CANCELLED: grpc.StatusCode.CANCELLED,
    FailureReason.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureReason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    FailureReason.PROTOCOL_ERROR: grpc.StatusCode.INVALID_ARGUMENT,
    FailureReason.INTERNAL: grpc.StatusCode.INTERNAL,
}

# The reason a status means when the peer did not say (no or unknown metadata).
_REASON_BY_CODE: dict[grpc.StatusCode, FailureReason] = {
    grpc.StatusCode.DATA_LOSS: FailureReason.CHECKSUM_MISMATCH,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureReason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: FailureReason.PEER_UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND: FailureReason.UNKNOWN_TRANSFER,
    grpc.StatusCode.FAILED_PRECONDITION: FailureReason.INCOMPATIBLE,
    grpc.StatusCode.ABORTED: FailureReason.INCOMPLETE,
    grpc.StatusCode.CANCELLED: FailureReason.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureReason.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED: FailureReason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: FailureReason.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT: FailureReason.PROTOCOL_ERROR,
    grpc.StatusCode.OUT_OF_RANGE: FailureReason.PROTOCOL_ERROR,
    grpc.StatusCode.UNIMPLEMENTED: FailureReason.PROTOCOL_ERROR,
    grpc.StatusCode.ALREADY_EXISTS: FailureReason.PROTOCOL_ERROR,
    grpc.StatusCode.INTERNAL: FailureReason.INTERNAL,
    grpc.StatusCode.UNKNOWN: FailureReason.INTERNAL,
}


def reason_to_grpc_code(reason: FailureReason) -> grpc.StatusCode:
    return _CODE_BY_REASON[reason]


def reason_from_grpc(
    code: grpc.StatusCode, trailing_metadata: Iterable[tuple[str, str | bytes]] | None = None
) -> FailureReason:
    """The reason behind a failed call: the peer's metadata if it named one, else the code's default."""
    for key, value in trailing_metadata or ():
        if key == FAILURE_METADATA_KEY:
            name = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            try:
                return FailureReason(name)
            except ValueError:
                break  # a newer peer's reason: fall back to what the status code means
    if code == grpc.StatusCode.OK:
        raise ValueError("an OK status is not a failure")
    return _REASON_BY_CODE[code]


@dataclass(frozen=True)
class TransferFailure:
    """A typed failure: the reason and a human-readable detail."""

    reason: FailureReason
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reason, FailureReason):
            raise TypeError(f"reason must be a FailureReason, got {self.reason!r}")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return reason_to_grpc_code(self.reason)

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


class TransferRejected(Exception):
    """Raised by a sink or target to refuse a transfer (or a write) for a typed reason."""

    def __init__(self, code: FailureReason, detail: str = "") -> None:
        if not isinstance(code, FailureReason):
            raise TypeError(f"code must be a FailureReason, got {code!r}")
        super().__init__(f"{code.value}: {detail}" if detail else code.value)
        self.code = code
        self.detail = detail

    @property
    def failure(self) -> TransferFailure:
        return TransferFailure(self.code, self.detail)
