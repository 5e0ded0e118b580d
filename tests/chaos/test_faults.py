"""One test per fault and per disaggregated state it can hit, on a real local Ray cluster through the
gRPC client API (tiny built-in model, fp32).

Every test asserts the invariants of docs/architecture.md ("Invariants"): the request ends exactly
once (tokens, or a status that names the cause); free blocks on every live instance return to their
start; a recovered request yields exactly the tokens of a fault-free run (greedy and seeded); no
corrupted block is read (a failed transfer never completes, and the tokens are exact); only legal
transitions happen (the router's table, and no instance report that contradicts it); the cluster
serves new requests after.

Faults are aimed at single requests by naming their hops in the fault plan: a request whose client id
is "x" runs as "x.p1" (prefill), "x.g1" (generation; "x.g2" when the transfer is retried) and "x.c1"
(recomputed locally), and the KV transfer of "x.g1" carries that id on the wire.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import pytest
from cluster_harness import ClusterHarness, await_state  # noqa: I001 - shared test helpers

from cluster.client import DuetError
from cluster.deploy.config import ClusterConfig
from cluster.router.config import ConfigError
from worker.default_model import margin_corpus

PROMPTS = margin_corpus(0, 16)  # certified free of greedy near-ties for 32 new tokens
LONG = [p for p in PROMPTS if len(p) >= 64]  # >= 4 blocks: >= 2 chunks of 64 KiB per transfer
HOLD_S = 60.0
HEALTH = {"heartbeat_interval_s": 0.25, "dead_after_s": 3.0}
TIMEOUTS = {"context_s": 60.0, "reservation_s": 6.0, "transfer_s": 20.0, "generation_s": 60.0}
TRANSFER_FAULTS = ["drop", "delay", "duplicate", "reorder", "corrupt", "truncate", "stall", "close"]


def _rules() -> list[dict]:
    rules = []
    for kind in TRANSFER_FAULTS:
        rule = {"kind": kind, "request_ids": [f"t-{kind}*.g1"], "chunk": 0 if kind in ("corrupt", "drop", "delay", "reorder", "duplicate") else 1}
        if kind in ("delay", "stall"):
            rule["seconds"] = 0.5
        rules.append(rule)
    rules += [
        # Process faults: park the request where the instance is to be killed or stopped.
        {"kind": "hold", "state": "CONTEXT_INIT", "seconds": HOLD_S, "request_ids": ["kill-p-wait*.p1"]},
        {"kind": "hold", "state": "CONTEXT_IN_PROGRESS", "seconds": HOLD_S, "request_ids": ["kill-p-prefill*.p1"]},
        {"kind": "delay", "seconds": 10.0, "chunk": 0, "request_ids": ["kill-p-transfer*.g1", "kill-g-receive*.g1"]},
        {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": HOLD_S, "request_ids": ["kill-g-init*.g1"]},
        {"kind": "hold", "state": "GENERATION_IN_PROGRESS", "seconds": HOLD_S, "request_ids": ["kill-g-generate*.g1", "stop-*.g1"]},
        # Resource faults.
        {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": HOLD_S, "request_ids": ["no-reservation*.g1"]},
        {"kind": "expire", "side": "receiver", "chunk": 0, "request_ids": ["reservation-expires*.g1"]},
        {"kind": "hold", "state": "CONTEXT_INIT", "seconds": HOLD_S, "request_ids": ["queue-*.p1"]},
    ]
    return rules


@pytest.fixture(scope="module", params=["grpc", "shm"])
def cluster(ray_cluster, request):
    # Every fault point applies on both data planes (the instances share a host: "shm" is really used).
    config = ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "device": "cpu",
            "instances": [
                {"role": "PREFILL", "count": 2, "num_cpus": 0.4},
                {"role": "GENERATION", "count": 2, "num_cpus": 0.4},
            ],
            # No prefix reuse: a request whose prompt a reference run cached would have one chunk
            # left, and a hold in CONTEXT_IN_PROGRESS (after the first chunk) would hold nothing.
            "engine": {
                "num_blocks": 512, "tokens_per_block": 16, "chunk_unit_tokens": 16, "max_num_tokens": 64, "enable_prefix_reuse": False,
            },
            "router": {
                "health": HEALTH,
                "timeouts": TIMEOUTS,
                "admission": {"max_queued_requests": 12, "max_buffered_events": 64},
                "placement": {"prefill_policy": {"name": "round_robin"}, "generation_policy": {"name": "round_robin"}},
            },
            "frontend": {"port": 0, "metrics_port": 0, "http_port": 0},
            "faults": {"enabled": True, "seed": 11, "rules": _rules()},
            # Small chunks: a transfer has several, so faults can hit one mid-stream.
            "kv_transfer": {
                "sender": {"max_chunk_bytes": 65536},
                "receiver": {"max_chunk_bytes": 65536},
                "data_plane": request.param,
            },
            "max_restarts": 20,
            "seed": 3,
        }
    )
    harness = ClusterHarness(config).start()
    yield harness
    harness.stop()


# --- helpers -------------------------------------------------------------------------------------------
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 1234, "ignore_eos": True}


def _prompt(index: int) -> list[int]:
    return PROMPTS[index % len(PROMPTS)]


def reference(cluster, prompt, params) -> tuple[int, ...]:
    """The tokens of a fault-free run (a request id no fault rule matches)."""
    with cluster.client(timeout_s=120) as client:
        return client.complete(prompt, client_request_id=f"ref-{time.monotonic_ns()}", **params).token_ids


def wait_healthy(cluster, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = cluster.status()
        if all(i.health.value == "HEALTHY" for i in status.instances):
            return
        time.sleep(0.2)
    raise AssertionError(f"instances not healthy: {[(i.instance_id, i.health.value) for i in cluster.status().instances]}")


def check_invariants(cluster) -> None:
    """Blocks back to their start everywhere, legal transitions only, and the cluster still serves."""
    wait_healthy(cluster)
    free = cluster.settle(timeout_s=60)
    assert free and all(f == t for f, t in free.values()), free
    cluster.assert_no_router_bug()
    extra = cluster.status().extra
    assert extra["illegal_transitions"] == 0 and extra["inconsistent_reports"] == 0, extra
    with cluster.client(timeout_s=60) as client:
        done = client.complete(_prompt(0), max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(done.token_ids) == 4


def run_in_background(cluster, request_id: str, prompt, params):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    client = cluster.client(timeout_s=180)

    def go():
        try:
            return client.complete(prompt, client_request_id=request_id, **params)
        finally:
            client.close()

    future = pool.submit(go)
    pool.shutdown(wait=False)
    return future


def actor_of(cluster, instance_id: str):
    return cluster.deployment.actors[instance_id]


def info_of(cluster, instance_id: str):
    return cluster.run(cluster.deployment.clients[instance_id].get_info())


def hop_instance(cluster, request_id: str, phase: str) -> str:
    with cluster.client(timeout_s=30) as client:
        uses = client.get_request(request_id).instances
    return [u.instance_id for u in uses if u.phase == phase][-1]


# --- transfer faults (they hit TRANSMISSION) -----------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", TRANSFER_FAULTS)
def test_transfer_fault_is_recovered_with_identical_tokens(cluster, kind, params) -> None:
    prompt = LONG[TRANSFER_FAULTS.index(kind) % len(LONG)]
    expected = reference(cluster, prompt, params)
    request_id = f"t-{kind}-{'g' if params is GREEDY else 's'}"
    with cluster.client(timeout_s=120) as client:
        done = client.complete(prompt, client_request_id=request_id, **params)
    assert done.token_ids == expected
    details = " | ".join(e.detail for e in done.timeline)
    hops = [(w.phase, w.attempt) for w in done.instances]
    if kind in ("delay", "duplicate", "reorder"):
        assert hops == [("prefill", 1), ("generation", 1)], hops  # harmless: no recovery needed
    else:
        # The first transfer failed (its KV never became usable) and was retried: "x.g2".
        assert ("generation", 2) in hops, (hops, details)
        assert "retry transfer" in details
    check_invariants(cluster)


# --- process faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "state", "victim_phase"),
    [
        ("kill-p-wait", "CONTEXT_WAIT", "prefill"),
        ("kill-p-prefill", "CONTEXT_IN_PROGRESS", "prefill"),
        ("kill-p-transfer", "TRANSMISSION", "prefill"),
        ("kill-g-init", "GENERATION_INIT", "generation"),
        ("kill-g-receive", "TRANSMISSION", "generation"),
        ("kill-g-generate", "GENERATING", "generation"),
    ],
)
def test_killed_instance_in_each_state_loses_nothing(cluster, ray_cluster, name, state, victim_phase) -> None:
    prompt = _prompt(len(name))
    expected = reference(cluster, prompt, GREEDY)
    future = run_in_background(cluster, name, prompt, GREEDY)
    with cluster.client(timeout_s=30) as client:
        await_state(client, name, state)
    victim = hop_instance(cluster, name, victim_phase)
    ray_cluster.kill(actor_of(cluster, victim), no_restart=False)  # Ray restarts it
    done = future.result(timeout=180)
    assert done.token_ids == expected
    # Recovered because of the kill: the instance was declared dead, or the peer vanished mid-transfer.
    assert any("died" in e.detail or "unavailable" in e.detail.lower() for e in done.timeline), [e.detail for e in done.timeline]
    check_invariants(cluster)


def test_stall_shorter_than_the_health_bound_fails_nothing(cluster) -> None:
    prompts = [_prompt(i) for i in range(4)]
    expected = [reference(cluster, p, GREEDY) for p in prompts]
    victim = "generation-0"
    pid = info_of(cluster, victim).pid
    futures = [run_in_background(cluster, f"short-stall-{i}", p, GREEDY) for i, p in enumerate(prompts)]
    time.sleep(0.3)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(HEALTH["dead_after_s"] / 3)
    os.kill(pid, signal.SIGCONT)
    results = [f.result(timeout=120) for f in futures]
    assert [r.token_ids for r in results] == expected
    for result in results:
        assert all(w.attempt == 1 for w in result.instances), result.instances  # no recovery was needed
        assert not any("died" in e.detail for e in result.timeline)
    check_invariants(cluster)


def test_stall_longer_than_the_health_bound_is_declared_dead_and_recovered(cluster) -> None:
    prompt = _prompt(7)
    expected = reference(cluster, prompt, GREEDY)
    future = run_in_background(cluster, "stop-long", prompt, GREEDY)
    with cluster.client(timeout_s=30) as client:
        await_state(client, "stop-long", "GENERATING")
    victim = hop_instance(cluster, "stop-long", "generation")
    pid = info_of(cluster, victim).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        done = future.result(timeout=120)  # recovered elsewhere while the victim is frozen
    finally:
        os.kill(pid, signal.SIGCONT)
    assert done.token_ids == expected
    assert any("died" in e.detail for e in done.timeline)
    # Thawed, it re-registers (same process) and gives back whatever the stale attempt held.
    check_invariants(cluster)
    assert info_of(cluster, victim).pid == pid


def test_stage_deadline_shorter_than_the_health_bound_is_rejected() -> None:
    with pytest.raises(ConfigError) as error:
        ClusterConfig.from_dict({"router": {"health": {"heartbeat_interval_s": 1, "dead_after_s": 10}, "timeouts": {"reservation_s": 5}}})
    assert "reservation_s" in str(error.value)


# --- resource faults ----------------------------------------------------------------------------------
def test_generation_instance_that_cannot_reserve_in_time_is_bypassed(cluster) -> None:
    prompt = _prompt(9)
    expected = reference(cluster, prompt, SEEDED)
    with cluster.client(timeout_s=120) as client:
        done = client.complete(prompt, client_request_id="no-reservation", **SEEDED)
    assert done.token_ids == expected
    assert any("GENERATION_INIT exceeded" in e.detail for e in done.timeline), [e.detail for e in done.timeline]
    check_invariants(cluster)


def test_reservation_that_expires_before_the_kv_arrives_is_recovered(cluster) -> None:
    prompt = _prompt(10)
    expected = reference(cluster, prompt, GREEDY)
    with cluster.client(timeout_s=120) as client:
        done = client.complete(prompt, client_request_id="reservation-expires", **GREEDY)
    assert done.token_ids == expected
    assert any("RESERVATION_EXPIRED" in e.detail for e in done.timeline), [e.detail for e in done.timeline]
    check_invariants(cluster)


def test_full_queue_refuses_with_resource_exhausted_and_recovers(cluster) -> None:
    held = [run_in_background(cluster, f"queue-{i}", _prompt(i), GREEDY) for i in range(12)]
    with cluster.client(timeout_s=30) as client:
        deadline = time.monotonic() + 30
        while cluster.call(lambda: cluster.router.num_in_flight) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(DuetError) as error:
            client.complete(_prompt(13), max_tokens=4, temperature=0.0)
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for i in range(12):
            client.abort(f"queue-{i}")
    for future in held:
        assert future.result(timeout=60).finish_reason == "abort"
    check_invariants(cluster)


# --- client faults ------------------------------------------------------------------------------------
def test_a_client_that_stops_reading_holds_nothing_forever(cluster) -> None:
    """A stalled reader costs only bounded buffers: the cluster keeps serving others meanwhile, and
    its request ends (completed into the transport's flow-control window, or cut off once the
    router's per-request buffer is full) with its blocks freed. The cut-off itself is covered
    deterministically by tests/integration/test_router_local.py."""
    with cluster.client(timeout_s=120) as client:
        stream = client.generate(
            _prompt(11), max_tokens=1500, temperature=0.0, ignore_eos=True, logprobs=5, client_request_id="slow-reader"
        )
        next(stream)  # read one event, then stop reading
        with cluster.client(timeout_s=60) as other:
            done = other.complete(_prompt(12), max_tokens=8, temperature=0.0, ignore_eos=True)
            assert len(done.token_ids) == 8
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline:
            with cluster.client(timeout_s=30) as checker:
                view = checker.get_request("slow-reader")
            state = view.state
            if state in ("COMPLETE", "ABORTED", "ERROR"):
                break
            time.sleep(0.2)
        assert state == "COMPLETE" or (state == "ABORTED" and "stopped reading" in view.error), (state, view.error)
        stream.close()
    check_invariants(cluster)
