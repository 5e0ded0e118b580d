"""The gRPC channels of a KV sender to one receiver, and the KvTransfer calls on them
(worker/kv_transfer/sender.py caches them per receiver; worker/kv_transfer/push.py calls them)."""

from __future__ import annotations

import grpc

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_transfer.receiver import SERVICE_NAME

_PREPARE = f"/{SERVICE_NAME}/Prepare"
_PUSH = f"/{SERVICE_NAME}/Push"
_COMMIT = f"/{SERVICE_NAME}/Commit"
_ABORT = f"/{SERVICE_NAME}/Abort"


def _identity(frame: bytes) -> bytes:
    return frame


class Connections:
    """The channels to one receiver and the callables on them."""

    def __init__(self, channels: list[grpc.Channel]) -> None:
        self.channels = channels
        # The receiver declined a shared-memory offer (another host, or gRPC only): later pushes to
        # it take no segment from the pool for an offer it would decline again.
        self.shm_declined = False
        first = channels[0]
        self.prepare = first.unary_unary(
            _PREPARE, request_serializer=pb.KvPrepareRequest.SerializeToString, response_deserializer=pb.KvPrepareResponse.FromString
        )
        self.commit = first.unary_unary(
            _COMMIT, request_serializer=pb.KvCommitRequest.SerializeToString, response_deserializer=pb.KvCommitResponse.FromString
        )
        self.abort = first.unary_unary(
            _ABORT, request_serializer=pb.KvAbortRequest.SerializeToString, response_deserializer=pb.KvAbortResponse.FromString
        )
        self.pushes = [
            channel.stream_unary(_PUSH, request_serializer=_identity, response_deserializer=pb.KvPushResponse.FromString)
            for channel in channels
        ]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
