"""KV hand-over between two instances in separate processes (Ray actors), control over gRPC on
127.0.0.1, bytes over each data plane: gRPC streams and shared memory (forced, so that a transfer
that could not use it fails).

The KV that arrives is byte-identical to what was sent, generation continues with the tokens of a
MIXED instance (greedy and seeded), and each fault kind of the injector gives its documented
outcome, with free blocks back at their start on both sides. A SIGKILLed sender or receiver leaves
no shared-memory segment once its instances are stopped and swept (what the launcher does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from worker.default_model import margin_corpus
from worker.engine_types import EngineConfig
from worker.kv_transfer import shm
from worker.kv_transfer.failures import FailureReason
from worker.protocol import (
    Abort,
    Ack,
    Decoder,
    Digest,
    Encoder,
    GetInfo,
    InstanceInfo,
    InstanceRole,
    KvDigest,
    Poll,
    PollBatch,
    Push,
    PushResult,
    Release,
    Reply,
    RequestOutput,
    RequestType,
    Submit,
    SubmitRequest,
)
from worker.sampling import SamplingParams

TOKEN = "test-cluster-token-0123456789abcdef"
SHM_TAG = "handover"
DATA_PLANES = ["grpc", "shm"]
PROMPTS = margin_corpus(0, 16)
LONG = [p for p in PROMPTS if len(p) >= 64][:6]  # >= 4 blocks: several 64 KiB chunks per transfer
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=4321, ignore_eos=True)


def _spec(instance_id: str, role: InstanceRole, faults=None, data_plane: str = "auto", shm_tag: str = SHM_TAG, sender=None):
    from worker.instance import InstanceSpec

    return InstanceSpec(
        instance_id,
        EngineConfig(role=role, num_blocks=128, tokens_per_block=16, reservation_timeout_s=20.0),
        dtype="float32",
        device="cpu",
        cluster_token=TOKEN,
        torch_threads=1,
        faults=faults,
        sender={"max_chunk_bytes": 64 * 1024, "data_plane": data_plane, **(sender or {})},
        receiver={"max_chunk_bytes": 64 * 1024, "data_plane": data_plane},
        shm_tag=shm_tag,
    ).to_bytes()


def _reply(data: bytes, expected: type):
    reply = Decoder(Reply).decode(data)
    assert isinstance(reply, expected), reply
    return reply


def _call(ray, actor, command, expected: type, timeout: float | None = None):
    """One command through the instance's single entry point, encoded as the router sends it."""
    return _reply(ray.get(actor.handle.remote(Encoder().encode(command)), timeout=timeout), expected)


def _actor(ray, instance_id: str, role: InstanceRole, faults=None, data_plane: str = "auto", shm_tag: str = SHM_TAG, sender=None):
    from worker.instance import Instance

    remote = ray.remote(num_cpus=0.25, max_concurrency=8, max_restarts=0)(Instance)
    actor = remote.remote(_spec(instance_id, role, faults, data_plane, shm_tag, sender))
    info = _call(ray, actor, GetInfo(), InstanceInfo, timeout=120)
    return actor, info


@dataclass
class Mailbox:
    """What one actor reported, accumulated across polls."""

    outputs: list[RequestOutput] = field(default_factory=list)
    reservations: list = field(default_factory=list)
    pushes: list[PushResult] = field(default_factory=list)
    last: PollBatch | None = None

    def add(self, batch: PollBatch) -> None:
        self.outputs.extend(batch.outputs)
        self.reservations.extend(batch.reservations)
        self.pushes.extend(batch.push_results)
        self.last = batch

    def final(self, request_id: str) -> RequestOutput | None:
        done = [o for o in self.outputs if o.request_id == request_id and o.finished]
        assert len(done) <= 1, "a request ended twice"
        return done[0] if done else None


def _poll(ray, actors_boxes, until, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = ray.get([actor.handle.remote(Encoder().encode(Poll(0.2))) for actor, _ in actors_boxes], timeout=30)
        for (_, box), data in zip(actors_boxes, batches, strict=True):
            box.add(_reply(data, PollBatch))
        if until():
            return
    raise AssertionError("timed out waiting for the instances")


@dataclass
class Handover:
    first: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    push: PushResult | None = None
    prefill_final: RequestOutput | None = None
    generation_final: RequestOutput | None = None
    sent_digest: str = ""
    received_digest: str = ""
    reserved_after_s: float = 0.0


def run_handover(ray, prefill, generation, request_id: str, prompt, params, push_deadline_s: float = 3.0) -> Handover:
    (p_actor, _), (g_actor, g_info) = prefill, generation
    p_box, g_box = Mailbox(), Mailbox()
    result = Handover()
    _call(ray, p_actor, Submit(SubmitRequest(request_id, tuple(prompt), params, RequestType.CONTEXT_ONLY)), Ack)
    _poll(ray, [(p_actor, p_box)], lambda: any(o.request_id == request_id and (o.context_done or o.finished) for o in p_box.outputs))
    result.first = next(o for o in p_box.outputs if o.request_id == request_id and o.new_token_ids).new_token_ids
    result.sent_digest = _call(ray, p_actor, KvDigest(request_id, len(prompt)), Digest).sha256
    submitted = time.monotonic()
    _call(ray, g_actor, Submit(SubmitRequest(request_id, tuple(prompt), params, RequestType.GENERATION_ONLY, result.first)), Ack)
    _poll(ray, [(g_actor, g_box)], lambda: any(r.request_id == request_id for r in g_box.reservations) or g_box.final(request_id) is not None)
    result.reserved_after_s = time.monotonic() - submitted
    reservation = next(r for r in g_box.reservations if r.request_id == request_id)
    _call(ray, p_actor, Push(request_id, g_info.transfer_address, reservation.transfer_id, push_deadline_s), Ack)
    _poll(
        ray,
        [(p_actor, p_box), (g_actor, g_box)],
        lambda: any(p.request_id == request_id for p in p_box.pushes)
        and (g_box.final(request_id) is not None or any(o.request_id == request_id and o.new_token_ids for o in g_box.outputs)),
    )
    result.push = next(p for p in p_box.pushes if p.request_id == request_id)
    if result.push.ok:
        result.received_digest = _digest_if_alive(ray, g_actor, request_id, len(prompt))
    else:
        _call(ray, p_actor, Release(request_id, FailureReason(result.push.reason), result.push.detail), Ack)
    _poll(ray, [(p_actor, p_box), (g_actor, g_box)], lambda: p_box.final(request_id) is not None and g_box.final(request_id) is not None)
    result.prefill_final = p_box.final(request_id)
    result.generation_final = g_box.final(request_id)
    result.tokens = list(result.first) + [t for o in g_box.outputs if o.request_id == request_id for t in o.new_token_ids]
    return result


def _digest_if_alive(ray, actor, request_id: str, num_tokens: int) -> str:
    try:
        return _call(ray, actor, KvDigest(request_id, num_tokens), Digest).sha256
    except Exception:  # noqa: BLE001 - finished already: the test then relies on the tokens
        return ""


def free_blocks(ray, actor) -> tuple[int, int]:
    batch = _call(ray, actor, Poll(0.0), PollBatch)
    return batch.load.free_blocks, batch.load.total_blocks


def mixed_tokens(ray, mixed, request_id: str, prompt, params) -> list[int]:
    actor, _ = mixed
    box = Mailbox()
    _call(ray, actor, Submit(SubmitRequest(request_id, tuple(prompt), params)), Ack)
    _poll(ray, [(actor, box)], lambda: box.final(request_id) is not None)
    return [t for o in box.outputs if o.request_id == request_id for t in o.new_token_ids]


@pytest.fixture(scope="module", params=DATA_PLANES)
def cluster(ray_cluster, request):
    ray = ray_cluster
    plane = request.param
    # One prefill/generation pair serves every fault kind: each rule matches its own request ids.
    sender_rules = [
        {"kind": "drop", "request_ids": ["drop"], "chunk": 1},
        {"kind": "delay", "request_ids": ["delay"], "seconds": 0.3},
        {"kind": "duplicate", "request_ids": ["duplicate"]},
        {"kind": "reorder", "request_ids": ["reorder"], "chunk": 0},
        {"kind": "corrupt", "request_ids": ["corrupt"], "chunk": 1},
        {"kind": "truncate", "request_ids": ["truncate"], "chunk": 1},
        {"kind": "stall", "request_ids": ["stall"], "chunk": 1, "seconds": 0.3},
        {"kind": "close", "request_ids": ["close"], "chunk": 1},
        {"kind": "stall", "request_ids": ["retried.g1"], "chunk": 1},  # a push's faults match its target's id
    ]
    receiver_rules = [
        {"kind": "drop", "side": "receiver", "request_ids": ["r-drop"], "chunk": 1},
        {"kind": "delay", "side": "receiver", "request_ids": ["r-delay"], "seconds": 0.3},
        {"kind": "stall", "side": "receiver", "request_ids": ["r-stall"], "chunk": 1, "seconds": 0.3},
        {"kind": "expire", "side": "receiver", "request_ids": ["r-expire"], "chunk": 1},
        {"kind": "refuse", "side": "receiver", "request_ids": ["r-refuse"]},
        {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": 1.0, "request_ids": ["hold"]},
    ]
    prefill = _actor(ray, f"p0-{plane}", InstanceRole.PREFILL, {"enabled": True, "seed": 1, "rules": sender_rules}, plane)
    generation = _actor(ray, f"g0-{plane}", InstanceRole.GENERATION, {"enabled": True, "seed": 1, "rules": receiver_rules}, plane)
    mixed = _actor(ray, f"m0-{plane}", InstanceRole.MIXED, data_plane=plane)
    yield ray, prefill, generation, mixed
    for actor, _ in (prefill, generation, mixed):
        ray.kill(actor)
    shm.sweep_when_owners_exit(SHM_TAG, wait_s=10.0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handover_is_byte_identical_and_continues_like_mixed(cluster, params) -> None:
    ray, prefill, generation, mixed = cluster
    for index, prompt in enumerate(LONG[:3]):
        request_id = f"ok-{params.temperature}-{index}"
        expected = mixed_tokens(ray, mixed, request_id, prompt, params)
        result = run_handover(ray, prefill, generation, request_id, prompt, params)
        assert result.push.ok and result.push.bytes_sent > 0
        assert result.prefill_final.handed_over
        assert result.received_digest in ("", result.sent_digest)
        assert result.tokens == expected
    assert free_blocks(ray, prefill[0]) == (128, 128)
    assert free_blocks(ray, generation[0]) == (128, 128)


def test_received_kv_is_byte_identical(cluster) -> None:
    ray, prefill, generation, _ = cluster
    # Long generations so the receiver still holds the request when the digest is taken.
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    result = run_handover(ray, prefill, generation, "digest", LONG[4], params)
    assert result.push.ok
    assert result.received_digest == result.sent_digest


# (request id, sender outcome reason or None for success, receiver transfer reason or None)
FAULT_CASES = [
    ("drop", "INCOMPLETE", "INCOMPLETE"),
    ("delay", None, None),
    ("duplicate", None, None),
    ("reorder", None, None),
    ("corrupt", "CHECKSUM_MISMATCH", "CHECKSUM_MISMATCH"),
    ("truncate", "INCOMPLETE", "INCOMPLETE"),
    ("stall", "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
    ("close", "PEER_UNAVAILABLE", "PEER_UNAVAILABLE"),
    ("r-drop", "INCOMPLETE", "INCOMPLETE"),
    ("r-delay", None, None),
    ("r-stall", "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
    ("r-expire", "RESERVATION_EXPIRED", "RESERVATION_EXPIRED"),
    ("r-refuse", "RESOURCE_EXHAUSTED", "__still_reserved__"),
]


@pytest.mark.parametrize(("request_id", "sender_reason", "receiver_reason"), FAULT_CASES, ids=[c[0] for c in FAULT_CASES])
def test_each_fault_kind_has_its_documented_outcome(cluster, request_id, sender_reason, receiver_reason) -> None:
    ray, prefill, generation, mixed = cluster
    prompt = LONG[5]
    expected = mixed_tokens(ray, mixed, f"ref-{request_id}", prompt, GREEDY)
    result = _run_with_abort_on_refusal(ray, prefill, generation, request_id, prompt)
    if sender_reason is None:
        assert result.push.ok, result.push
        assert result.tokens == expected
        assert result.prefill_final.handed_over
    else:
        assert not result.push.ok and result.push.reason == sender_reason, result.push
        assert result.prefill_final.error.code.value == "TRANSFER_FAILED"
        generation_error = result.generation_final.error
        if receiver_reason == "__still_reserved__":
            assert generation_error.code.value == "ABORTED"
        else:
            assert generation_error.transfer_reason == receiver_reason, generation_error
    assert free_blocks(ray, prefill[0]) == (128, 128)
    assert free_blocks(ray, generation[0]) == (128, 128)


def _run_with_abort_on_refusal(ray, prefill, generation, request_id, prompt) -> Handover:
    if request_id != "r-refuse":
        return run_handover(ray, prefill, generation, request_id, prompt, GREEDY, push_deadline_s=2.0)
    # A refused Prepare never opens the reservation: the receiver keeps it until the router aborts
    # it (here, once the push failed) or it expires.
    (p_actor, _), (g_actor, g_info) = prefill, generation
    p_box, g_box = Mailbox(), Mailbox()
    _call(ray, p_actor, Submit(SubmitRequest(request_id, tuple(prompt), GREEDY, RequestType.CONTEXT_ONLY)), Ack)
    _poll(ray, [(p_actor, p_box)], lambda: any(o.context_done for o in p_box.outputs))
    first = next(o for o in p_box.outputs if o.context_done).new_token_ids
    _call(ray, g_actor, Submit(SubmitRequest(request_id, tuple(prompt), GREEDY, RequestType.GENERATION_ONLY, first)), Ack)
    _poll(ray, [(g_actor, g_box)], lambda: bool(g_box.reservations))
    _call(ray, p_actor, Push(request_id, g_info.transfer_address, g_box.reservations[0].transfer_id, 2.0), Ack)
    _poll(ray, [(p_actor, p_box)], lambda: bool(p_box.pushes))
    push = p_box.pushes[0]
    _call(ray, p_actor, Release(request_id, FailureReason(push.reason or "INTERNAL"), push.detail), Ack)
    _call(ray, g_actor, Abort(request_id, "router gave up"), Ack)
    _poll(ray, [(p_actor, p_box), (g_actor, g_box)], lambda: p_box.final(request_id) is not None and g_box.final(request_id) is not None)
    return Handover(first=first, push=push, prefill_final=p_box.final(request_id), generation_final=g_box.final(request_id))


def test_a_stalled_push_is_cancelled_when_the_transfer_is_retried(cluster) -> None:
    """The router gives a stalled push up and retries the transfer to a new reservation: the
    instance cancels the stalled push (it would pin the request's blocks until its deadline, here
    30 s), the retry commits, and the request ends handed over once both pushes returned."""
    ray, prefill, generation, mixed = cluster
    (p_actor, _), (g_actor, g_info) = prefill, generation
    p_box, g_box = Mailbox(), Mailbox()
    prompt = LONG[5]
    expected = mixed_tokens(ray, mixed, "ref-retried", prompt, GREEDY)
    _call(ray, p_actor, Submit(SubmitRequest("retried", tuple(prompt), GREEDY, RequestType.CONTEXT_ONLY)), Ack)
    _poll(ray, [(p_actor, p_box)], lambda: any(o.request_id == "retried" and o.context_done for o in p_box.outputs))
    first = next(o for o in p_box.outputs if o.request_id == "retried" and o.context_done).new_token_ids

    def reserve(engine_id: str) -> str:
        _call(ray, g_actor, Submit(SubmitRequest(engine_id, tuple(prompt), GREEDY, RequestType.GENERATION_ONLY, first)), Ack)
        _poll(ray, [(g_actor, g_box)], lambda: any(r.request_id == engine_id for r in g_box.reservations))
        return next(r for r in g_box.reservations if r.request_id == engine_id).transfer_id

    stalled = reserve("retried.g1")
    started = time.monotonic()
    _call(ray, p_actor, Push("retried", g_info.transfer_address, stalled, 30.0, "retried.g1"), Ack)
    time.sleep(0.5)  # the push stalls on its second chunk
    _call(ray, g_actor, Abort("retried.g1", "transfer retried"), Ack)  # what the router does, then
    retry = reserve("retried.g2")
    _call(ray, p_actor, Push("retried", g_info.transfer_address, retry, 30.0, "retried.g2"), Ack)
    _poll(
        ray, [(p_actor, p_box), (g_actor, g_box)],
        lambda: p_box.final("retried") is not None and g_box.final("retried.g2") is not None, timeout_s=20.0,
    )
    assert time.monotonic() - started < 15.0  # not the stalled push's 30 s deadline
    results = {p.transfer_id: p for p in p_box.pushes if p.request_id == "retried"}
    assert results[retry].ok, results[retry]
    assert results[stalled].reason == FailureReason.CANCELLED.value and "superseded" in results[stalled].detail, results[stalled]
    assert p_box.final("retried").handed_over
    assert list(first) + [t for o in g_box.outputs if o.request_id == "retried.g2" for t in o.new_token_ids] == expected
    assert free_blocks(ray, p_actor) == (128, 128)
    assert free_blocks(ray, g_actor) == (128, 128)


def test_hold_keeps_a_request_in_its_state(cluster) -> None:
    ray, prefill, generation, mixed = cluster
    expected = mixed_tokens(ray, mixed, "ref-hold", LONG[5], GREEDY)
    result = run_handover(ray, prefill, generation, "hold", LONG[5], GREEDY)
    assert result.reserved_after_s >= 1.0  # held in DISAGG_GENERATION_INIT for a second
    assert result.push.ok and result.tokens == expected


@pytest.mark.parametrize("plane", DATA_PLANES)
@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_killed_peer_fails_the_transfer_and_frees_the_survivor(ray_cluster, side, plane) -> None:
    ray = ray_cluster
    # The receiver hears of a dead sender through a stream the death breaks, so the sender dies
    # with one open: its 4 chunks go over 2 streams (0 and 2 on the first, 1 and 3 on the other),
    # and the kill comes as the first stream asks for chunk 2, once gRPC has written chunk 0. (At
    # chunk 1 over 4 streams, the kill came as the second stream began: when the first had already
    # delivered its one chunk and its end, the receiver had no open stream to see break, and the
    # transfer ended at its deadline, DEADLINE_EXCEEDED.)
    chunk = 2 if side == "sender" else 1
    rule = {"kind": "kill", "side": side, "request_ids": ["doomed"], "chunk": chunk}
    plan = {"enabled": True, "seed": 3, "rules": [rule]}
    tag = f"kill{side[0]}{plane}"
    sender = {"num_streams": 2}
    prefill = _actor(ray, f"pk-{side}-{plane}", InstanceRole.PREFILL, plan if side == "sender" else None, plane, tag, sender)
    generation = _actor(ray, f"gk-{side}-{plane}", InstanceRole.GENERATION, plan if side == "receiver" else None, plane, tag)
    (p_actor, _), (g_actor, g_info) = prefill, generation
    p_box, g_box = Mailbox(), Mailbox()
    prompt = LONG[0]
    _call(ray, p_actor, Submit(SubmitRequest("doomed", tuple(prompt), GREEDY, RequestType.CONTEXT_ONLY)), Ack)
    _poll(ray, [(p_actor, p_box)], lambda: any(o.context_done for o in p_box.outputs))
    first = next(o for o in p_box.outputs if o.context_done).new_token_ids
    _call(ray, g_actor, Submit(SubmitRequest("doomed", tuple(prompt), GREEDY, RequestType.GENERATION_ONLY, first)), Ack)
    _poll(ray, [(g_actor, g_box)], lambda: bool(g_box.reservations))
    _call(ray, p_actor, Push("doomed", g_info.transfer_address, g_box.reservations[0].transfer_id, 3.0), Ack)
    survivor, survivor_box = (g_actor, g_box) if side == "sender" else (p_actor, p_box)
    if side == "sender":
        _poll(ray, [(survivor, survivor_box)], lambda: survivor_box.final("doomed") is not None)
        assert survivor_box.final("doomed").error.transfer_reason == "PEER_UNAVAILABLE"
    else:
        _poll(ray, [(survivor, survivor_box)], lambda: bool(survivor_box.pushes))
        push = survivor_box.pushes[0]
        assert not push.ok and push.reason == "PEER_UNAVAILABLE"
        _call(ray, p_actor, Release("doomed", FailureReason(push.reason), push.detail), Ack)
        _poll(ray, [(survivor, survivor_box)], lambda: survivor_box.final("doomed") is not None)
    assert free_blocks(ray, survivor) == (128, 128)
    if plane == "shm" and side == "sender":
        assert shm.segments(tag), "the killed sender's segment should be there until the sweep"
    for actor in (p_actor, g_actor):
        ray.kill(actor)
    # What the launcher does when a cluster stops: wait for the killed processes, sweep the tag.
    shm.sweep_when_owners_exit(tag, wait_s=10.0)
    assert shm.segments(tag) == []
