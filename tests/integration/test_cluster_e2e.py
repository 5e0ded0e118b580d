"""End to end on a local Ray cluster through the gRPC client API.

Disaggregated (PREFILL + GENERATION) equals colocated (MIXED) token for token, greedy and seeded;
abort and deadline in every global state free every block; bad requests get INVALID_ARGUMENT and
the cluster keeps serving; a killed instance is restarted by Ray, re-registers and is used again;
KV-aware placement beats round robin on prefix-cache hits.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from cluster_harness import ClusterHarness, await_state

from cluster.client import DuetError
from cluster.deploy.config import ClusterConfig
from cluster.router.instance_client import ray_actor_state
from worker.default_model import margin_corpus

PROMPTS = margin_corpus(0, 16)  # certified free of greedy near-ties for 32 new tokens
HOLD_S = 60.0
FAST_HEALTH = {"heartbeat_interval_s": 0.25, "dead_after_s": 2.0}
TIMEOUTS = {"context_s": 120.0, "reservation_s": 120.0, "transfer_s": 120.0, "generation_s": 120.0}

# Holds that park chosen requests in each global state (the request ids are the client's).
HOLD_RULES = [
    {"kind": "hold", "state": "CONTEXT_INIT", "seconds": HOLD_S, "request_ids": ["*-in-wait.p1"]},
    {"kind": "hold", "state": "CONTEXT_IN_PROGRESS", "seconds": HOLD_S, "request_ids": ["*-in-ctx.p1"]},
    {"kind": "hold", "state": "DISAGG_GENERATION_INIT", "seconds": HOLD_S, "request_ids": ["*-in-init.g1"]},
    {"kind": "delay", "seconds": 8.0, "request_ids": ["*-in-trans.g1"], "chunk": 0},
    {"kind": "hold", "state": "GENERATION_IN_PROGRESS", "seconds": HOLD_S, "request_ids": ["*-in-gen.g1"]},
]


def config(**overrides) -> ClusterConfig:
    data = {
        "dtype": "float32",
        "device": "cpu",
        "instances": [
            {"role": "PREFILL", "count": 1, "num_cpus": 0.5},
            {"role": "GENERATION", "count": 1, "num_cpus": 0.5},
        ],
        "engine": {"num_blocks": 512, "tokens_per_block": 16, "chunk_unit_tokens": 16, "max_num_tokens": 64},
        "router": {"health": FAST_HEALTH, "timeouts": TIMEOUTS},
        "frontend": {"port": 0, "metrics_port": 0, "http_port": 0},
        "seed": 1,
    }
    data.update(overrides)
    return ClusterConfig.from_dict(data)


def run_batch(harness: ClusterHarness, requests: list[dict]) -> list:
    with harness.client(timeout_s=120) as client:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(client.complete, r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in requests]
            return [f.result() for f in futures]


def mixed_requests() -> list[dict]:
    requests = []
    for index, prompt in enumerate(PROMPTS):
        requests.append({"prompt": prompt, "max_tokens": 8 + (index % 4) * 8, "temperature": 0.0, "ignore_eos": True})
        requests.append({"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 100 + index, "ignore_eos": True})
    return requests


@pytest.fixture(scope="module")
def disagg(ray_cluster):
    harness = ClusterHarness(config(faults={"enabled": True, "seed": 1, "rules": HOLD_RULES})).start()
    yield harness
    harness.stop()


def test_disaggregated_equals_colocated_through_grpc(ray_cluster, disagg) -> None:
    requests = mixed_requests()
    colocated = ClusterHarness(
        config(instances=[{"role": "MIXED", "count": 2, "num_cpus": 0.5}], router={"health": FAST_HEALTH, "timeouts": TIMEOUTS, "placement": {"disaggregation": "never"}})
    ).start()
    try:
        expected = run_batch(colocated, requests)
    finally:
        colocated.stop()
    got = run_batch(disagg, requests)
    assert len(requests) >= 20
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert [w.phase for w in have.instances] == ["prefill", "generation"]
        assert [e.state for e in have.timeline] == [
            "QUEUED", "CONTEXT_WAIT", "CONTEXT_IN_PROGRESS", "GENERATION_INIT", "TRANSMISSION", "GENERATING", "COMPLETE",
        ]
        assert [w.phase for w in want.instances] == ["colocated"]
    free = disagg.settle()
    assert all(f == t for f, t in free.values()), free
    assert disagg.status().extra["inconsistent_reports"] == 0


STATES = [("in-wait", "CONTEXT_WAIT"), ("in-ctx", "CONTEXT_IN_PROGRESS"), ("in-init", "GENERATION_INIT"), ("in-trans", "TRANSMISSION"), ("in-gen", "GENERATING")]


@pytest.mark.parametrize(("suffix", "state"), STATES, ids=[s for _, s in STATES])
@pytest.mark.parametrize("how", ["abort", "deadline", "cancel"])
def test_abort_deadline_and_cancel_in_every_state_free_every_block(disagg, suffix, state, how) -> None:
    request_id = f"{how}-{suffix}"
    # Longer than max_num_tokens (several prefill chunks), and its own first token so that no
    # earlier test's cached prefix shortens its prefill.
    salt = [ord(c) for c in request_id][:8]
    prompt = salt + max(PROMPTS, key=len) * 3
    with disagg.client(timeout_s=60) as client, concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        timeout = 3.0 if how == "deadline" else None
        stream = pool.submit(
            lambda: list(client.generate(prompt, max_tokens=2000, temperature=0.0, ignore_eos=True, client_request_id=request_id, timeout_s=timeout))
        )
        if how == "deadline":
            with pytest.raises(DuetError) as error:
                stream.result(timeout=60)
            assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            await_state(client, request_id, state, timeout_s=30.0)
            if how == "abort":
                assert client.abort(request_id).aborted
                events = stream.result(timeout=60)
                assert events[-1].finish_reason == "abort"
            else:
                # The client goes away: the front end aborts the request for it.
                stream.cancel()
                client.close()
        with disagg.client(timeout_s=30) as checker:
            deadline = time.monotonic() + 30
            while checker.get_request(request_id).state not in ("ABORTED", "ERROR") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert checker.get_request(request_id).state in ("ABORTED", "ERROR")
    free = disagg.settle()
    assert all(f == t for f, t in free.values()), (request_id, free)


def test_bad_requests_get_invalid_argument_and_the_cluster_keeps_serving(disagg) -> None:
    with disagg.client(timeout_s=30) as client:
        for kwargs, field in [
            ({"prompt": [1, 2, 99999]}, "token_ids"),
            ({"prompt": "x", "temperature": -1.0}, "temperature"),
            ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
            ({"prompt": "x", "top_p": 2.0}, "top_p"),
            ({"prompt": ""}, "text"),
        ]:
            prompt = kwargs.pop("prompt")
            with pytest.raises(DuetError) as error:
                client.complete(prompt, **kwargs)
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, error.value
            assert field in str(error.value)
        done = client.complete(PROMPTS[0], max_tokens=4, temperature=0.0)
        assert done.finish_reason in ("stop", "length")
        assert all(i.health == "HEALTHY" for i in client.cluster_status().instances)


def test_killed_instance_restarts_reregisters_and_serves_again(disagg, ray_cluster) -> None:
    ray = ray_cluster
    deployment = disagg.cluster.deployment
    victim_id = next(iid for iid in deployment.actors if iid.startswith("generation"))
    # What the router's probe of an overdue poll reads: Ray's record of the actor changes at once.
    assert ray_actor_state(deployment.actors[victim_id]) == "ALIVE"
    ray.kill(deployment.actors[victim_id], no_restart=False)
    states = [ray_actor_state(deployment.actors[victim_id])]
    while states[-1] == "ALIVE" and len(states) < 100:  # ray.kill reaches the control store asynchronously
        time.sleep(0.02)
        states.append(ray_actor_state(deployment.actors[victim_id]))
    assert states[-1] in ("RESTARTING", "DEAD"), states
    deadline = time.monotonic() + 90
    seen_unhealthy = False
    while time.monotonic() < deadline:
        health = {i.instance_id: i.health.value for i in disagg.status().instances}
        seen_unhealthy = seen_unhealthy or health[victim_id] != "HEALTHY"
        if seen_unhealthy and health[victim_id] == "HEALTHY":
            break
        time.sleep(0.2)
    assert seen_unhealthy and health[victim_id] == "HEALTHY", health
    with disagg.client(timeout_s=60) as client:
        done = client.complete(PROMPTS[1], max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [w.instance_id for w in done.instances] == ["prefill-0", victim_id]
    assert len(done.token_ids) == 8


def test_kv_aware_placement_beats_round_robin_on_prefix_hits(ray_cluster) -> None:
    # 3 prefixes over 2 prefill instances: round robin sends each prefix to both in turn.
    prefixes = [p * 3 for p in margin_corpus(21, 3, min_len=40, max_len=40)]
    workload = [prefix + [1 + suffix, 2 + suffix] for suffix in range(6) for prefix in prefixes]
    cached = {}
    for policy in ("round_robin", "kv_aware"):
        harness = ClusterHarness(
            config(
                instances=[{"role": "PREFILL", "count": 2, "num_cpus": 0.4}, {"role": "GENERATION", "count": 1, "num_cpus": 0.4}],
                router={"health": FAST_HEALTH, "timeouts": TIMEOUTS, "placement": {"prefill_policy": {"name": policy}}},
            )
        ).start()
        try:
            with harness.client(timeout_s=120) as client:
                # One at a time, so that every request sees what the earlier ones left cached.
                cached[policy] = sum(client.complete(p, max_tokens=2, temperature=0.0).usage.cached_tokens for p in workload)
        finally:
            harness.stop()
    assert cached["kv_aware"] > cached["round_robin"], cached


def test_metrics_and_timeline_log(ray_cluster, tmp_path) -> None:
    import json
    import urllib.request

    log = tmp_path / "timelines.jsonl"
    harness = ClusterHarness(config(frontend={"port": 0, "metrics_port": 0, "timeline_log": str(log)})).start()
    try:
        with harness.client(timeout_s=60) as client:
            for index in range(3):
                client.complete(PROMPTS[index], max_tokens=6, temperature=0.0, ignore_eos=True, client_request_id=f"m-{index}")
        port = harness.cluster.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        harness.stop()
    assert 'duet_requests_total{outcome="COMPLETE",status="OK"} 3.0' in text
    assert "duet_ttft_seconds_count 3.0" in text and "duet_tpot_seconds_count 3.0" in text
    assert 'duet_transfers_total{result="committed"} 3.0' in text
    assert 'duet_state_seconds_count{state="TRANSMISSION"} 3.0' in text
    assert 'duet_instance_kv_utilization_ratio{instance="prefill-0",role="PREFILL"}' in text
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["client_request_id"] for r in records] == ["m-0", "m-1", "m-2"]
    assert records[0]["timeline"][-1]["state"] == "COMPLETE" and records[0]["usage"]["completion_tokens"] == 6


def test_sigkilled_instances_leave_no_shared_memory_segment_once_the_cluster_stops(ray_cluster) -> None:
    """kv_transfer.data_plane shm on one host: the sender's pooled segment outlives a SIGKILL of its
    process (nothing closes the pool) and goes with the launcher's sweep when the cluster stops."""
    import os
    import signal

    from worker.kv_transfer import shm
    from worker.protocol import Decoder, Encoder, GetInfo, InstanceInfo, Reply

    ray = ray_cluster
    harness = ClusterHarness(config(kv_transfer={"data_plane": "shm"})).start()
    tag = harness.cluster.deployment.deployment_id
    try:
        with harness.client(timeout_s=120) as client:
            done = client.complete(PROMPTS[2], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [w.phase for w in done.instances] == ["prefill", "generation"]
        assert shm.segments(tag), "the sender keeps its segment pooled"
        for actor in harness.cluster.deployment.actors.values():
            info = Decoder(Reply).decode(ray.get(actor.handle.remote(Encoder().encode(GetInfo())), timeout=30))
            assert isinstance(info, InstanceInfo)
            os.kill(info.pid, signal.SIGKILL)  # sender and receiver
        deadline = time.monotonic() + 30
        while shm.live_owners(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shm.segments(tag), "a SIGKILLed sender cannot remove its own segment"
    finally:
        harness.stop()
    assert shm.segments(tag) == []
