"""DuetClient and AsyncDuetClient against a real front end on loopback and the scripted FakeRouter:
typed events, collected completions, DuetError with status codes (and the result sent before an
error status), leaving a stream early aborts the request, deadlines, the unary calls."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from test_frontend_support import FIXED_TIME_S, FakeRouter, Script, ServerThread, free_port

from cluster.client import (
    AsyncDuetClient,
    ClientConfigError,
    ClientTls,
    Completion,
    Delta,
    DuetClient,
    DuetError,
    InstanceWork,
    Result,
    StateChange,
    Usage,
    build_generate_request,
)
from cluster.router.api import ErrorKind, RouterError

pytestmark = pytest.mark.timeout(60)

SCRIPTS = {
    "stop-string": Script(tokens=(((1,), "a"),), finish_reason="stop", stop_reason="END"),
    "stop-token": Script(tokens=(((1,), "a"),), finish_reason="stop", stop_reason=7),
    "gated": Script(gated=True),
    "hang": Script(tokens=(((1,), "x"),), hang=True),
    "hang-silent": Script(tokens=(), hang=True),
    "final-error": Script(error_kind=ErrorKind.ABORTED, error_message="KV transfer failed 3 times"),
    "busy": Script(submit_error=RouterError(ErrorKind.RESOURCE_EXHAUSTED, "admission queue is full")),
}


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeRouter(SCRIPTS)) as running:
        yield running


@pytest.fixture
def client(server):
    with DuetClient(server.target) as opened:
        yield opened


def _new_request_id(server, before: set[str]) -> str:
    (request_id,) = set(server.router.live_ids()) - before
    return request_id


# ---- sync -------------------------------------------------------------------------------------


def test_generate_yields_typed_deltas_then_one_result(server, client) -> None:
    events = []
    for event in client.generate("gated", max_tokens=3, temperature=0.0):
        events.append(event)
        if isinstance(event, Delta):
            server.router.release(event.request_id)  # one token per delta, deterministically
    assert [type(e) for e in events] == [Delta, Delta, Delta, Result]
    assert [e.token_ids for e in events[:3]] == [(72,), (105,), (33,)]
    result = events[-1]
    assert isinstance(result, Result) and result.request_id == events[0].request_id
    assert result.finish_reason == "length" and result.stop_reason is None
    assert result.usage == Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    assert result.timeline[0] == StateChange("QUEUED", FIXED_TIME_S, "", "")
    assert result.instances == (InstanceWork("p0", "PREFILL", "prefill", 1), InstanceWork("g0", "GENERATION", "generation", 1))


def test_sampling_arguments_reach_the_router(server, client) -> None:
    before = len(server.router.submitted)
    client.complete(
        [5, 6, 7], max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=11, stop="END", stop_token_ids=[2], ignore_eos=True,
        include_stop_str_in_output=True, logprobs=2, min_tokens=1, skip_special_tokens=False,
        client_request_id="mine-args", timeout_s=5.0, priority=0.9,
    )  # fmt: skip
    request = server.router.submitted[before]
    s = request.sampling
    assert request.prompt_token_ids == (5, 6, 7) and request.client_request_id == "mine-args"
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.min_p) == (4, 0.7, 5, 0.9, 0.1)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.seed) == (1.2, 0.5, -0.5, 11)
    assert s.stop == ("END",) and s.stop_token_ids == (2,) and s.ignore_eos and s.include_stop_str_in_output
    assert (s.logprobs, s.min_tokens, s.skip_special_tokens) == (2, 1, False)
    assert request.timeout_s == 5.0 and request.priority == 0.9


def test_complete_collects_the_stream(client) -> None:
    done = client.complete("hello")
    assert isinstance(done, Completion)
    assert done.text == "Hi!" and done.token_ids == (72, 105, 33) and done.finish_reason == "length"
    assert done.usage.completion_tokens == 3 and done.timeline[-1].state == "COMPLETE" and len(done.instances) == 2
    assert done.ttft_s is not None and 0 <= done.ttft_s <= done.total_s


def test_stop_reasons(client) -> None:
    assert client.complete("stop-string").stop_reason == "END"
    by_token = client.complete("stop-token")
    assert by_token.finish_reason == "stop" and by_token.stop_reason == 7


def test_an_error_status_raises_duet_error_with_the_result(client) -> None:
    seen = []
    with pytest.raises(DuetError) as raised:
        for event in client.generate("final-error"):
            seen.append(event)
    assert seen and all(isinstance(e, Delta) for e in seen)  # no Result for a failed request
    assert "".join(e.text for e in seen) == "Hi!"
    error = raised.value
    assert error.code == grpc.StatusCode.ABORTED and error.message == "KV transfer failed 3 times"
    assert error.request_id == seen[0].request_id
    assert error.result is not None and error.result.timeline[-1].state == "ERROR"
    with pytest.raises(DuetError) as raised:
        client.complete("busy")
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and raised.value.result is None
    with pytest.raises(DuetError) as raised:
        client.complete("hi", top_p=2.0)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and raised.value.message.startswith("sampling.top_p:")


def test_leaving_a_stream_early_aborts_the_request(server, client) -> None:
    before = set(server.router.live_ids())
    for event in client.generate("hang"):
        assert isinstance(event, Delta)
        break  # the generator is dropped here, which cancels the call
    assert server.router.wait_for_abort(_new_request_id(server, before))


def test_client_deadline_aborts_at_the_server(server) -> None:
    before = set(server.router.live_ids())
    with DuetClient(server.target, timeout_s=0.3) as hurried:
        with pytest.raises(DuetError) as raised:
            hurried.complete("hang-silent")
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.router.wait_for_abort(_new_request_id(server, before))


def test_unary_calls(server, client) -> None:
    events = client.generate("hang", client_request_id="mine-unary")
    first = next(events)
    status = client.get_request(client_request_id="mine-unary")
    assert status.request_id == first.request_id and status.client_request_id == "mine-unary"
    assert status.state == "GENERATING" and status.result is None and status.timeline[1].instance_id == "p0"
    aborted = client.abort(first.request_id)
    assert aborted.aborted and aborted.state == "GENERATING"
    rest = list(events)
    assert isinstance(rest[-1], Result) and rest[-1].finish_reason == "abort"
    ended = client.get_request(first.request_id)
    assert ended.state == "ABORTED" and ended.result is not None and ended.result.finish_reason == "abort"
    assert not client.abort(client_request_id="mine-unary").aborted
    with pytest.raises(DuetError) as raised:
        client.get_request("req-none")
    assert raised.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ClientConfigError):
        client.abort("a", client_request_id="b")


def test_cluster_status_and_health(server, client) -> None:
    status = client.cluster_status()
    p0, g0 = status.instances
    assert (p0.instance_id, p0.role, p0.health, p0.free_blocks, p0.total_blocks) == ("p0", "PREFILL", "HEALTHY", 90, 128)
    assert g0.health == "DRAINING" and p0.last_report_s == FIXED_TIME_S - 1.5
    assert status.queue_depth == 3 and dict(status.requests_by_state) == {"GENERATING": 5, "QUEUED": 3}
    assert status.fallbacks == ("retry_transfer", "recompute_local", "fail") and status.placement_policy == "kv_aware"
    assert status.timestamp_s == FIXED_TIME_S
    assert client.health()
    server.call(server.server.set_serving(False))
    try:
        assert not client.health()
    finally:
        server.call(server.server.set_serving(True))


def test_unreachable_front_end() -> None:
    with DuetClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(DuetError) as raised:
            client.complete("hello")
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE and raised.value.unreachable
        with pytest.raises(DuetError) as raised:
            client.health()
        assert raised.value.unreachable


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: build_generate_request("hi", max_tokens=-1), "max_tokens"),
        (lambda: build_generate_request("hi", temperature="hot"), "temperature"),
        (lambda: build_generate_request(b"bytes"), "prompt"),
        (lambda: build_generate_request([1, -2]), "prompt"),
        (lambda: build_generate_request("hi", timeout_s=0), "timeout_s"),
        (lambda: DuetClient(""), "target"),
        (lambda: DuetClient(token="has space"), "token"),
        (lambda: DuetClient(timeout_s=-1), "timeout_s"),
        (lambda: ClientTls(root_certificates_pem=b"not pem"), "root_certificates_pem"),
        (lambda: ClientTls(certificate_chain_pem=b"-----BEGIN CERTIFICATE-----"), "private_key_pem"),
    ],
)
def test_arguments_that_cannot_be_sent_raise_client_config_error(call, field) -> None:
    with pytest.raises(ClientConfigError, match=field):
        call()


def test_an_empty_token_id_list_is_still_a_token_id_prompt() -> None:
    request = build_generate_request([])
    assert request.WhichOneof("prompt") == "token_ids"


def test_unset_arguments_leave_fields_unset_for_the_server_defaults() -> None:
    request = build_generate_request("hi", stop=None, stop_token_ids=None)
    sampling = request.sampling
    assert sampling.max_tokens == 16 and sampling.HasField("max_tokens")
    for field in ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "min_tokens", "skip_special_tokens"):
        assert not sampling.HasField(field), field
    assert list(sampling.stop) == [] and list(sampling.stop_token_ids) == []
    assert not request.HasField("timeout") and not request.HasField("priority") and not request.HasField("client_request_id")
    assert list(build_generate_request("hi", stop="END").sampling.stop) == ["END"]
    assert not build_generate_request("hi", max_tokens=None).sampling.HasField("max_tokens")


# ---- async ------------------------------------------------------------------------------------


def test_async_client(server) -> None:
    async def run() -> None:
        async with AsyncDuetClient(server.target) as client:
            events = [event async for event in client.generate("hello", max_tokens=3)]
            assert isinstance(events[-1], Result) and all(isinstance(e, Delta) for e in events[:-1])
            assert "".join(e.text for e in events[:-1]) == "Hi!" and events[-1].usage.completion_tokens == 3
            done = await client.complete("stop-string")
            assert done.text == "a" and done.stop_reason == "END" and done.ttft_s is not None
            with pytest.raises(DuetError) as raised:
                await client.complete("final-error")
            assert raised.value.code == grpc.StatusCode.ABORTED and raised.value.result is not None

            before = set(server.router.live_ids())
            async with contextlib.aclosing(client.generate("hang", client_request_id="async-hang")) as stream:
                async for event in stream:
                    assert isinstance(event, Delta)
                    break
            assert await asyncio.to_thread(server.router.wait_for_abort, _new_request_id(server, before))

            status = await client.get_request(client_request_id="async-hang")
            assert status.state == "ABORTED"
            assert not (await client.abort(client_request_id="async-hang")).aborted
            cluster = await client.cluster_status()
            assert [i.instance_id for i in cluster.instances] == ["p0", "g0"]
            assert await client.health()
            with pytest.raises(DuetError) as raised:
                await client.get_request("req-none")
            assert raised.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())


def test_async_client_deadline_and_unreachable(server) -> None:
    async def run() -> None:
        before = set(server.router.live_ids())
        async with AsyncDuetClient(server.target, timeout_s=0.3) as client:
            with pytest.raises(DuetError) as raised:
                await client.complete("hang-silent")
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await asyncio.to_thread(server.router.wait_for_abort, _new_request_id(server, before))
        async with AsyncDuetClient(f"127.0.0.1:{free_port()}") as nowhere:
            with pytest.raises(DuetError) as raised:
                await nowhere.cluster_status()
            assert raised.value.unreachable

    asyncio.run(run())
