"""The client SDK of duet's gRPC API (it imports only duet_wire, grpc and protobuf).

    from cluster.client import DuetClient
    with DuetClient("127.0.0.1:50051") as client:
        for event in client.generate("Hello", max_tokens=16, temperature=0):
            print(event)
"""

from cluster.client.sdk import (
    AbortResult,
    AsyncDuetClient,
    ClientConfigError,
    ClientTls,
    ClusterStatus,
    Completion,
    Delta,
    DuetClient,
    DuetError,
    InstanceStatus,
    InstanceWork,
    ModelStatus,
    RequestStatus,
    Result,
    StateChange,
    TokenLogprob,
    TopLogprob,
    Usage,
    build_generate_request,
    cluster_status_from_proto,
    delta_from_proto,
    result_from_proto,
)

__all__ = [
    "AbortResult",
    "AsyncDuetClient",
    "ClientConfigError",
    "ClientTls",
    "ClusterStatus",
    "ModelStatus",
    "Completion",
    "Delta",
    "DuetClient",
    "DuetError",
    "InstanceStatus",
    "InstanceWork",
    "RequestStatus",
    "Result",
    "StateChange",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "build_generate_request",
    "cluster_status_from_proto",
    "delta_from_proto",
    "result_from_proto",
]
