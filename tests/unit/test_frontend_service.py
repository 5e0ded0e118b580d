"""The Duet service over real gRPC on loopback against the scripted FakeRouter: stream order and the
final message, router errors and error finals as statuses, cancellation and deadlines aborting
the request, the unary RPCs, health, reflection, unknown fields and size limits."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_frontend_support import FIXED_TIME_S, WAIT_S, FakeRouter, Script, ServerThread

from cluster.frontend.service import REQUEST_ID_METADATA_KEY, FrontendError, FrontendServer
from cluster.router.api import ErrorKind, RouterError
from duet_wire.v1 import client_pb2 as pb
from duet_wire.v1 import client_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)
RPC_TIMEOUT_S = 10.0

SCRIPTS = {
    "stop-string": Script(tokens=(((1,), "a"), ((2,), "b")), finish_reason="stop", stop_reason="END"),
    "stop-token": Script(tokens=(((1,), "a"),), finish_reason="stop", stop_reason=7),
    "gated": Script(gated=True),
    "burst": Script(tokens=tuple(((i,), chr(65 + i % 26)) for i in range(200)), burst=True),
    "hang": Script(tokens=(((1,), "x"),), hang=True),
    "hang-silent": Script(tokens=(), hang=True),
    "slow-submit": Script(tokens=(), hang=True, submit_delay_s=0.4),
    "final-error": Script(error_kind=ErrorKind.ABORTED, error_message="KV transfer failed 3 times; giving up"),
    "stream-error": Script(tokens=(((1,), "a"),), stream_error=RouterError(ErrorKind.INTERNAL, "instance g0 died")),
    "broken": Script(no_final=True),
    **{
        f"refuse-{kind.name}": Script(submit_error=RouterError(kind, f"refused as {kind.name}"))
        for kind in ErrorKind
    },
    "refuse-field": Script(submit_error=RouterError(ErrorKind.INVALID_ARGUMENT, "too long for the model", field="text")),
}


@pytest.fixture(scope="module")
def served():
    with ServerThread(FakeRouter(SCRIPTS)) as server:
        with grpc.insecure_channel(server.target) as channel:
            yield server, pb_grpc.DuetStub(channel), channel


def _generate(stub, text: str, **kwargs) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(text=text, **kwargs), timeout=RPC_TIMEOUT_S))


def _kinds(responses: list[pb.GenerateResponse]) -> list[str]:
    return [r.WhichOneof("event") for r in responses]


def test_stream_is_deltas_then_one_result(served) -> None:
    server, stub, _ = served
    call = stub.Generate(pb.GenerateRequest(text="hello"), timeout=RPC_TIMEOUT_S)
    responses = list(call)
    kinds = _kinds(responses)
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"delta"}
    request_id = responses[0].request_id
    assert request_id and all(r.request_id == request_id for r in responses)
    assert dict(call.initial_metadata())[REQUEST_ID_METADATA_KEY] == request_id
    assert [t for r in responses[:-1] for t in r.delta.token_ids] == [72, 105, 33]
    assert "".join(r.delta.text for r in responses[:-1]) == "Hi!"
    result = responses[-1].result
    assert result.finish_reason == pb.FINISH_REASON_LENGTH and result.WhichOneof("stop_reason") is None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens) == (5, 3, 2)
    assert [e.state for e in result.timeline] == ["QUEUED", "CONTEXT_WAIT", "GENERATING", "COMPLETE"]
    first = result.timeline[0].timestamp
    assert first.seconds + first.nanos / 1e9 == FIXED_TIME_S and result.timeline[1].instance_id == "p0"
    assert [(u.instance_id, u.role, u.phase, u.attempt) for u in result.instances] == [
        ("p0", pb.INSTANCE_ROLE_PREFILL, "prefill", 1),
        ("g0", pb.INSTANCE_ROLE_GENERATION, "generation", 1),
    ]
    assert call.code() == grpc.StatusCode.OK


def test_each_token_goes_out_as_it_comes(served) -> None:
    server, stub, _ = served
    call = stub.Generate(pb.GenerateRequest(text="gated"), timeout=RPC_TIMEOUT_S)
    deltas = []
    for response in call:
        if response.WhichOneof("event") == "result":
            break
        deltas.append((tuple(response.delta.token_ids), response.delta.text))
        server.router.release(response.request_id)  # the next token exists only after this one arrived
    assert deltas == [((72,), "H"), ((105,), "i"), ((33,), "!")]


def test_tokens_that_pile_up_are_coalesced_into_one_delta(served) -> None:
    _, stub, _ = served
    responses = _generate(stub, "burst")
    assert _kinds(responses) == ["delta", "result"]
    assert list(responses[0].delta.token_ids) == list(range(200))
    assert responses[0].delta.text == "".join(chr(65 + i % 26) for i in range(200))
    assert responses[1].result.usage.completion_tokens == 200


def test_stop_reasons(served) -> None:
    _, stub, _ = served
    by_string = _generate(stub, "stop-string")[-1].result
    assert by_string.finish_reason == pb.FINISH_REASON_STOP and by_string.stop_string == "END"
    by_token = _generate(stub, "stop-token")[-1].result
    assert by_token.WhichOneof("stop_reason") == "stop_token_id" and by_token.stop_token_id == 7


@pytest.mark.parametrize("kind", list(ErrorKind), ids=lambda k: k.name)
def test_router_refusals_become_the_same_named_status(served, kind: ErrorKind) -> None:
    _, stub, _ = served
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stub, f"refuse-{kind.name}")
    assert raised.value.code() == getattr(grpc.StatusCode, kind.name)
    assert raised.value.details() == f"refused as {kind.name}"


def test_router_invalid_argument_names_its_field(served) -> None:
    _, stub, _ = served
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stub, "refuse-field")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "text: too long for the model"


def test_an_error_final_sends_the_result_then_ends_with_its_status(served) -> None:
    _, stub, _ = served
    call = stub.Generate(pb.GenerateRequest(text="final-error"), timeout=RPC_TIMEOUT_S)
    received = []
    with pytest.raises(grpc.RpcError) as raised:
        for response in call:
            received.append(response)
    assert _kinds(received)[-1] == "result" and set(_kinds(received)[:-1]) == {"delta"}
    assert received[-1].result.timeline[-1].state == "ERROR"
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert raised.value.details() == "KV transfer failed 3 times; giving up"


def test_a_router_error_mid_stream_ends_the_call_with_its_status(served) -> None:
    server, stub, _ = served
    aborts = len(server.router.aborts)
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stub, "stream-error")
    assert raised.value.code() == grpc.StatusCode.INTERNAL and raised.value.details() == "instance g0 died"
    assert len(server.router.aborts) == aborts  # the router ended it itself: nothing to abort


def test_a_stream_without_a_final_event_is_internal(served) -> None:
    _, stub, _ = served
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stub, "broken")
    assert raised.value.code() == grpc.StatusCode.INTERNAL


def test_client_cancel_aborts_the_request(served) -> None:
    server, stub, _ = served
    call = stub.Generate(pb.GenerateRequest(text="hang"), timeout=RPC_TIMEOUT_S)
    first = next(call)
    assert first.delta.text == "x"
    call.cancel()
    assert server.router.wait_for_abort(first.request_id), "the router was not told that the client left"
    assert server.router.get_request(request_id=first.request_id).state == "ABORTED"


def test_deadline_passing_aborts_the_request(served) -> None:
    server, stub, _ = served
    before = set(server.router.live_ids())
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(text="hang-silent"), timeout=0.3))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (request_id,) = set(server.router.live_ids()) - before
    assert server.router.wait_for_abort(request_id)


def test_cancel_while_the_router_admits_aborts_once_admitted(served) -> None:
    server, stub, _ = served
    before = set(server.router.live_ids())
    call = stub.Generate(pb.GenerateRequest(text="slow-submit"), timeout=RPC_TIMEOUT_S)
    time.sleep(0.1)  # the router is inside submit() (it takes 0.4 s)
    call.cancel()
    deadline = time.monotonic() + WAIT_S
    while not (set(server.router.live_ids()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    (request_id,) = set(server.router.live_ids()) - before
    assert server.router.wait_for_abort(request_id)


def test_abort_rpc(served) -> None:
    server, stub, _ = served
    call = stub.Generate(pb.GenerateRequest(text="hang", client_request_id="mine-abort"), timeout=RPC_TIMEOUT_S)
    first = next(call)
    response = stub.Abort(pb.AbortRequest(request=pb.RequestRef(client_request_id="mine-abort")), timeout=RPC_TIMEOUT_S)
    assert response.aborted and response.state == "GENERATING"
    rest = list(call)
    assert rest[-1].result.finish_reason == pb.FINISH_REASON_ABORT and call.code() == grpc.StatusCode.OK
    again = stub.Abort(pb.AbortRequest(request=pb.RequestRef(request_id=first.request_id)), timeout=RPC_TIMEOUT_S)
    assert not again.aborted and again.state == "ABORTED"
    with pytest.raises(grpc.RpcError) as raised:
        stub.Abort(pb.AbortRequest(request=pb.RequestRef(request_id="req-unknown")), timeout=RPC_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_get_request(served) -> None:
    _, stub, _ = served
    done = _generate(stub, "stop-string", client_request_id="mine-get")
    view = stub.GetRequest(pb.GetRequestRequest(request=pb.RequestRef(client_request_id="mine-get")), timeout=RPC_TIMEOUT_S)
    assert view.request_id == done[0].request_id and view.client_request_id == "mine-get"
    assert view.state == "COMPLETE" and view.result.stop_string == "END" and view.error == ""
    assert [e.state for e in view.timeline] == ["QUEUED", "CONTEXT_WAIT"] and view.instances[0].instance_id == "p0"
    anonymous = stub.GetRequest(pb.GetRequestRequest(request=pb.RequestRef(request_id=_generate(stub, "x")[0].request_id)), timeout=RPC_TIMEOUT_S)
    assert not anonymous.HasField("client_request_id")
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetRequest(pb.GetRequestRequest(request=pb.RequestRef(request_id="nope")), timeout=RPC_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_cluster_status(served) -> None:
    _, stub, _ = served
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=RPC_TIMEOUT_S)
    assert [i.instance_id for i in status.instances] == ["p0", "g0"]
    p0, g0 = status.instances
    assert (p0.role, p0.health, p0.address) == (pb.INSTANCE_ROLE_PREFILL, pb.INSTANCE_HEALTH_HEALTHY, "127.0.0.1:7001")
    assert g0.health == pb.INSTANCE_HEALTH_DRAINING
    assert (p0.load.free_blocks, p0.load.total_blocks, p0.load.cached_blocks) == (90, 128, 7)
    assert (p0.load.queued_requests, p0.load.running_requests, p0.load.active_transfers) == (1, 2, 1)
    assert p0.last_report.seconds + p0.last_report.nanos / 1e9 == FIXED_TIME_S - 1.5
    assert status.queue_depth == 3 and dict(status.requests_by_state) == {"QUEUED": 3, "GENERATING": 5}
    assert dict(status.requests_by_outcome) == {"COMPLETE": 40, "ERROR": 2}
    assert list(status.fallbacks) == ["retry_transfer", "recompute_local", "fail"]
    assert status.max_recovery_attempts == 3 and status.placement_policy == "kv_aware"


def test_health_serving_and_not_serving(served) -> None:
    server, _, channel = served
    health = health_pb2_grpc.HealthStub(channel)

    def check(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert check("") == serving and check("duet_wire.v1.Duet") == serving
    server.call(server.server.set_serving(False))
    try:
        assert check("") == not_serving and check("duet_wire.v1.Duet") == not_serving
    finally:
        server.call(server.server.set_serving(True))
    assert check("") == serving
    with pytest.raises(grpc.RpcError) as raised:
        check("no.such.Service")
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(served) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, _, channel = served
    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    assert {"duet_wire.v1.Duet", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert "grpc.reflection.v1.ServerReflection" in services
    described = database.FindFileContainingSymbol("duet_wire.v1.Duet")
    assert described.package == "duet_wire.v1"


def test_reflection_v1_answers_like_v1alpha(served) -> None:
    """Newer tools ask grpc.reflection.v1 (the same messages in another package)."""
    from grpc_reflection.v1alpha import reflection_pb2

    _, _, channel = served
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="duet_wire.v1.GenerateRequest"),
    ]
    listed, described = list(call(iter(requests), timeout=10))
    assert "duet_wire.v1.Duet" in {service.name for service in listed.list_services_response.service}
    assert described.file_descriptor_response.file_descriptor_proto


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_unknown_fields_are_ignored(served) -> None:
    _, _, channel = served
    known = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=3))
    # Field 99 (varint) at the top level and field 77 (bytes) inside `sampling` (field 3).
    sampling = known.sampling.SerializeToString() + _varint(77 << 3 | 2) + _varint(3) + b"new"
    raw = pb.GenerateRequest(text="hello").SerializeToString() + _varint(3 << 3 | 2) + _varint(len(sampling)) + sampling
    raw += _varint(99 << 3 | 0) + _varint(12345)
    assert pb.GenerateRequest.FromString(raw).sampling.max_tokens == 3
    generate = channel.unary_stream(
        "/duet_wire.v1.Duet/Generate", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
    )
    responses = list(generate(raw, timeout=RPC_TIMEOUT_S))
    assert responses[-1].WhichOneof("event") == "result" and "".join(r.delta.text for r in responses) == "Hi!"


def test_oversized_messages_are_resource_exhausted() -> None:
    router = FakeRouter()
    with ServerThread(router, max_message_bytes=64 * 1024) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.DuetStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(pb.GenerateRequest(text="x" * (65 * 1024)), timeout=RPC_TIMEOUT_S))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert router.submitted == [] and router.tokenized == []
        assert _kinds(list(stub.Generate(pb.GenerateRequest(text="fits"), timeout=RPC_TIMEOUT_S)))[-1] == "result"


def test_stop_aborts_requests_still_running() -> None:
    router = FakeRouter(SCRIPTS)
    with ServerThread(router) as server, grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.DuetStub(channel).Generate(pb.GenerateRequest(text="hang"), timeout=RPC_TIMEOUT_S)
        request_id = next(call).request_id
        server.call(server.server.stop(0.1))
        server.server = None
        assert router.wait_for_abort(request_id)
        with pytest.raises(grpc.RpcError):
            list(call)


def test_a_port_in_use_is_refused() -> None:
    with ServerThread(FakeRouter()) as first:

        async def second() -> None:
            await FrontendServer(FakeRouter(), port=first.port).start()

        with pytest.raises(FrontendError, match="cannot bind"):
            first.call(second())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"port": 70000}, "port"), ({"port": -1}, "port"), ({"host": ""}, "host"), ({"max_message_bytes": 10}, "max_message_bytes"), ({"tokens": "a-single-token-string"}, "tokens"), ({"tokens": ["short"]}, "token")],
)
def test_bad_server_settings_are_refused(kwargs, field) -> None:
    with pytest.raises((FrontendError, ValueError), match=field):
        FrontendServer(FakeRouter(), **kwargs)
