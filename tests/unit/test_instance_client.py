"""InstanceClient over an instance's single entry point: typed calls in, typed replies or the two
typed errors out (a refused input is InstanceRejected, never a health signal)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.router import instance_client
from cluster.router.instance_client import InstanceRejected, InstanceUnavailable, LocalInstanceClient
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason
from worker.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Command,
    Decoder,
    Drain,
    Drained,
    Encoder,
    GetInfo,
    InstanceInfo,
    InstanceRole,
    Ping,
    Poll,
    PollBatch,
    Pong,
    ProtocolError,
    Push,
    Rejected,
    Release,
    Submit,
    SubmitRequest,
    Unavailable,
)
from worker.sampling import SamplingParams

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="fp")
INFO = InstanceInfo("m0", InstanceRole.MIXED, "inc", "127.0.0.1:1", LAYOUT, 64, 264, 4096, 1, "cpu")


class _Spec:
    instance_id = "m0"


class FakeInstance:
    """Answers each command with the reply `answer` gives, recording the decoded commands."""

    spec = _Spec()

    def __init__(self, answer) -> None:
        self.answer = answer
        self.commands: list = []

    def handle(self, payload: bytes) -> bytes:
        command = Decoder(Command).decode(payload)
        self.commands.append(command)
        reply = self.answer(command)
        return reply if isinstance(reply, bytes) else Encoder().encode(reply)


def normal(command):
    match command:
        case GetInfo():
            return INFO
        case Ping():
            return Pong("inc")
        case Poll():
            return PollBatch("inc", 1)
        case Drain():
            return Drained(0)
    return Ack()


def run(coro):
    return asyncio.run(coro)


def test_each_call_sends_its_typed_command_and_returns_the_typed_reply():
    instance = FakeInstance(normal)
    client = LocalInstanceClient(instance)
    request = SubmitRequest("r.p1", (1, 2), SamplingParams(max_tokens=4))

    async def calls():
        return (
            await client.get_info(),
            await client.ping(),
            await client.submit(request),
            await client.abort("r.p1", "bye"),
            await client.push("r.p1", "127.0.0.1:2", "t-1", 2, "r.g1"),
            await client.release("r.p1", FailureReason.CANCELLED, "gave up"),
            await client.poll(0.5),
            await client.drain(1.0),
        )

    assert run(calls()) == (INFO, "inc", None, None, None, None, PollBatch("inc", 1), 0)
    assert instance.commands == [
        GetInfo(),
        Ping(),
        Submit(request),
        Abort("r.p1", "bye"),
        Push("r.p1", "127.0.0.1:2", "t-1", 2.0, "r.g1"),
        Release("r.p1", FailureReason.CANCELLED, "gave up"),
        Poll(0.5),
        Drain(1.0),
    ]


def test_a_refused_input_is_instance_rejected_naming_the_field():
    client = LocalInstanceClient(FakeInstance(lambda command: Rejected("prompt_token_ids", "token 999 is outside")))
    with pytest.raises(InstanceRejected) as info:
        run(client.submit(SubmitRequest("r", (1,), SamplingParams())))
    assert (info.value.field, info.value.message) == ("prompt_token_ids", "token 999 is outside")


def test_an_unavailable_instance_is_instance_unavailable():
    client = LocalInstanceClient(FakeInstance(lambda command: Unavailable("instance m0 is not accepting requests (draining)")))
    with pytest.raises(InstanceUnavailable, match="m0: instance m0 is not accepting requests"):
        run(client.submit(SubmitRequest("r", (1,), SamplingParams())))


def test_a_peer_on_another_protocol_version_is_unavailable_naming_both_versions():
    def old_code(command):
        data = bytearray(Encoder().encode(Ack()))
        data[1] = PROTOCOL_VERSION + 1  # [version, body]: a positive fixint
        return bytes(data)

    with pytest.raises(InstanceUnavailable, match=f"version {PROTOCOL_VERSION + 1}.*version {PROTOCOL_VERSION}"):
        run(LocalInstanceClient(FakeInstance(old_code)).ping())


def test_a_reply_of_the_wrong_kind_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="answered Ping with Ack, not Pong"):
        run(LocalInstanceClient(FakeInstance(lambda command: Ack())).ping())


def test_a_call_past_its_deadline_is_unavailable(monkeypatch):
    monkeypatch.setattr(instance_client, "CONTROL_TIMEOUT_S", 0.05)

    def slow(command):
        time.sleep(0.5)
        return Ack()

    client = LocalInstanceClient(FakeInstance(slow))
    with pytest.raises(InstanceUnavailable, match="Poll did not answer within 0.1s"):
        run(client.poll(0.05))  # a poll's deadline: its own wait plus CONTROL_TIMEOUT_S


def test_a_killed_client_is_unavailable_without_calling():
    instance = FakeInstance(normal)
    client = LocalInstanceClient(instance)
    client.killed = True
    with pytest.raises(InstanceUnavailable, match="killed"):
        run(client.ping())
    assert instance.commands == []


def test_a_restarted_instance_gets_a_certificate_reissued_by_the_deployers_ca_and_only_then():
    from cryptography import x509

    from worker.kv_transfer.certificates import DeploymentCa
    from worker.protocol import ReplaceTransferTls

    ca = DeploymentCa("d1")
    issued: list[str] = []

    def issue(instance_id: str):
        issued.append(instance_id)
        return ca.issue(instance_id)

    instance = FakeInstance(normal)
    assert run(LocalInstanceClient(instance).restarted()) is False  # no CA held: nothing to hand over
    assert instance.commands == []
    assert run(LocalInstanceClient(instance, issue_certificate=issue).restarted()) is True
    assert issued == ["m0"]
    [command] = instance.commands
    assert isinstance(command, ReplaceTransferTls)  # it crossed the codec whole: key, chain, CA
    certificate = x509.load_pem_x509_certificate(command.tls.certificate_chain_pem)
    assert certificate.issuer == x509.load_pem_x509_certificate(ca.root_pem).subject
    assert "PRIVATE KEY" not in repr(command)  # the key is never printed
    plain = FakeInstance(lambda command: Rejected("tls", "this instance's KV transfers are plain TCP"))
    with pytest.raises(InstanceRejected):
        run(LocalInstanceClient(plain, issue_certificate=issue).restarted())
