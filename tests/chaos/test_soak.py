"""The chaos soak, short (CI) version, through `duet chaos` itself: a few hundred requests against
2 PREFILL + 2 GENERATION with faults on about 15 % of the KV transfers and two instance kills; lost
requests, leaked blocks, token mismatches against the fault-free replay and illegal transitions must
all be 0, and the faults and kills must really have happened. The note reports a full run
(`duet chaos`, 1,000 requests).

Also, without a cluster: the soak's building blocks (workload, plan, kills, report arithmetic).
"""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.cli.chaos import EXIT_INVARIANT_BROKEN, add_chaos, main
from cluster.client import InstanceWork, StateChange
from cluster.loadgen.chaos import (
    FAULT_KINDS,
    MUST_BE_ZERO,
    KillRecord,
    RequestRecord,
    SoakConfig,
    SoakConfigError,
    SoakRequest,
    build_report,
    extra_latencies,
    fault_plan,
    faulty_cluster_config,
    kill_schedule,
    make_requests,
    planned_faults,
    recovery_cause,
    replay_cluster_config,
    timeline_recoveries,
)
from cluster.router.config import DisaggMode
from worker.kv_transfer.faults import FaultPlan
from worker.protocol import InstanceRole

SOAK_REQUESTS = 240
SOAK_KILL_EVERY = 100  # 2 kills
SOAK_FAULT_RATE = 0.15


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_short_soak_loses_nothing_leaks_nothing_and_matches_the_replay(ray_cluster, tmp_path, capsys) -> None:
    json_out = tmp_path / "soak.json"
    status = main(
        [
            "--requests", str(SOAK_REQUESTS),
            "--seed", "11",
            "--fault-rate", str(SOAK_FAULT_RATE),
            "--kill-every", str(SOAK_KILL_EVERY),
            "--no-progress",
            "--json-out", str(json_out),
        ]
    )
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    result = json.loads(last)
    assert json.loads(json_out.read_text()) == result
    figures, targets = result["figures"], result["targets"]
    assert result["bench"] == "chaos_soak"
    assert set(targets) == set(MUST_BE_ZERO)
    assert all(t["target"] == 0 and t["met"] == (t["value"] == 0) for t in targets.values())
    # The invariants.
    assert {name: targets[name]["value"] for name in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), out
    assert status == 0, out
    assert figures["unhealthy_after_settle"] == []
    # Every request was admitted and ended: completed, or failed with a status the cluster sent.
    assert figures["accepted"] == SOAK_REQUESTS
    assert figures["completed"] + sum(figures["failed_by_status"].values()) == SOAK_REQUESTS
    # Faults and kills really happened, and the cluster recovered from them.
    failed_transfers = {k: v for k, v in figures["transfer_counters"].items() if k.startswith("failed_")}
    assert sum(failed_transfers.values()) >= 5, figures["transfer_counters"]
    assert len(failed_transfers) >= 3, failed_transfers  # several kinds of failure, not one
    assert sum(figures["planned_faults"].values()) >= 10, figures["planned_faults"]
    assert figures["kills"] == figures["kills_recovered"] == (SOAK_REQUESTS - 1) // SOAK_KILL_EVERY
    assert figures["faults_fired"] >= 5 and figures["recovered"] >= 5, figures
    assert figures["extra_latency_p50_s"] is not None
    assert "PASS" in out


# ---- the building blocks, no cluster ----------------------------------------------------------


def test_the_workload_is_seeded_and_in_range() -> None:
    config = SoakConfig(requests=200, seed=4)
    requests = make_requests(config, vocab_size=264)
    assert requests == make_requests(config, vocab_size=264)
    assert requests != make_requests(SoakConfig(requests=200, seed=5), vocab_size=264)
    assert [r.client_request_id for r in requests[:2]] == ["soak-0", "soak-1"]
    assert all(config.min_prompt_tokens <= len(r.prompt_token_ids) <= config.max_prompt_tokens for r in requests)
    assert all(config.min_max_tokens <= r.max_tokens <= config.max_max_tokens for r in requests)
    assert all(0 <= t < 256 for r in requests for t in r.prompt_token_ids)
    greedy = sum(r.greedy for r in requests)
    assert 60 < greedy < 140  # a mix of greedy and seeded sampling
    # Some prompts share a prefix (so the prefix cache is part of the soak).
    heads = [r.prompt_token_ids[:16] for r in requests]
    assert len(set(heads)) < len(heads) - 20


def test_the_fault_plan_spreads_the_rate_over_every_kind_and_is_seeded() -> None:
    plan = fault_plan(seed=3, fault_rate=0.05)
    parsed = FaultPlan.from_mapping(plan)
    assert parsed.enabled and len(parsed.rules) == len(FAULT_KINDS) == 11
    assert {(r.kind.value, r.side.value) for r in parsed.rules} == set(FAULT_KINDS)
    assert all(r.scope.value == "transfer" for r in parsed.rules)
    assert sum(r.probability for r in parsed.rules) == pytest.approx(0.05)
    assert all(r.matches_request("soak-12.g1") and not r.matches_request("replay-12.g1") for r in parsed.rules)
    assert not FaultPlan.from_mapping(fault_plan(seed=3, fault_rate=0.0)).enabled

    requests = make_requests(SoakConfig(requests=2000, seed=3), vocab_size=264)
    planned = planned_faults(plan, requests)
    assert planned == planned_faults(plan, requests)
    assert planned != planned_faults(fault_plan(seed=4, fault_rate=0.05), requests)
    assert 60 <= len(planned) <= 140  # about 5 % of 2,000 first transfers
    kinds = {kind for kinds in planned.values() for kind in kinds}
    assert len(kinds) >= 9, kinds


def test_the_kill_schedule_is_seeded_and_every_k_requests() -> None:
    ids = ["prefill-0", "prefill-1", "generation-0", "generation-1"]
    config = SoakConfig(requests=1000, seed=2, kill_every=100)
    schedule = kill_schedule(config, ids)
    assert schedule == kill_schedule(config, list(reversed(ids)))
    assert [k.after_request for k in schedule] == [99 + 100 * i for i in range(9)]
    assert {k.instance_id for k in schedule} <= set(ids)
    assert kill_schedule(SoakConfig(requests=1000, kill_every=0), ids) == ()


def test_the_soak_deploys_a_faulty_pd_cluster_and_a_clean_colocated_one() -> None:
    config = SoakConfig(requests=500, kill_every=50, prefill=3, generation=2)
    faulty = faulty_cluster_config(config)
    roles = {g.role: g.count for g in faulty.instances}
    assert roles == {InstanceRole.PREFILL: 3, InstanceRole.GENERATION: 2}
    assert faulty.faults == fault_plan(config.seed, config.fault_rate)
    assert faulty.max_restarts > config.num_kills  # Ray restarts every victim
    assert faulty.dtype == "float32"
    clean = replay_cluster_config(config)
    assert [(g.role, g.count) for g in clean.instances] == [(InstanceRole.MIXED, 1)]
    assert clean.faults is None
    assert clean.router.placement.disaggregation is DisaggMode.NEVER
    assert clean.engine == faulty.engine  # same blocks, same chunking


@pytest.mark.parametrize(
    ("field", "value"),
    [("requests", 0), ("fault_rate", 1.5), ("fault_rate", float("nan")), ("kill_every", -1), ("concurrency", 0), ("lost_after_s", 0.0)],
)
def test_bad_settings_name_their_field(field, value) -> None:
    with pytest.raises(SoakConfigError) as error:
        SoakConfig(**{field: value})
    assert error.value.field == field


def test_the_command_line_refuses_bad_values_with_exit_status_2(capsys) -> None:
    assert main(["--fault-rate", "2"]) == 2
    assert "--fault-rate" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="duet")
    add_chaos(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--requests", "7", "--kill-every", "0", "--address", "ray://head:10001"])
    assert (args.requests, args.kill_every, args.address, args.fault_rate) == (7, 0, "ray://head:10001", 0.05)
    assert callable(args.handler)


def _request(index: int, max_tokens: int = 8) -> SoakRequest:
    return SoakRequest(index, (1, 2, 3), max_tokens, 0.0, 1.0, 5)


def _hops(*phases: tuple[str, int]) -> tuple[InstanceWork, ...]:
    return tuple(InstanceWork(f"i-{n}", "PREFILL", phase, attempt) for n, (phase, attempt) in enumerate(phases))


PD = _hops(("prefill", 1), ("generation", 1))


def _timeline(*details: tuple[str, str]) -> tuple[StateChange, ...]:
    return tuple(StateChange(state, 0.0, "", detail) for state, detail in details)


def _mixed_report():
    config = SoakConfig(requests=8)
    retried = _timeline(
        ("GENERATION_INIT", "retry transfer (KV transfer failed: CHECKSUM_MISMATCH: chunk 0: bad)"),
        ("GENERATING", "recompute locally on generation-1 (instance generation-0 died: restarted)"),
    )
    exhausted = _timeline(("ERROR", "KV transfer failed: INCOMPLETE: 3 cells; recovery exhausted"))
    records = [
        RequestRecord(_request(0), "OK", True, False, (1, 2), 1.0, PD),
        RequestRecord(_request(1), "OK", True, False, (1, 2), 3.0, PD),
        RequestRecord(_request(2), "OK", True, False, (4, 5), 4.5, _hops(("prefill", 1), ("generation", 1), ("generation", 2)), retried),
        RequestRecord(_request(3), "UNAVAILABLE", True, False, (), 2.0, PD, exhausted, "recovery exhausted"),
        RequestRecord(_request(4), "DEADLINE_EXCEEDED", True, True, (), 300.0),
        RequestRecord(_request(5), "RESOURCE_EXHAUSTED", False, False),
        RequestRecord(_request(6), "OK", True, False, (9, 9, 9), 2.0, _hops(("prefill", 1), ("recompute", 1))),
        RequestRecord(_request(7), "OK", True, False, (7,), 1.5, PD),
    ]
    replayed = {
        "soak-0": RequestRecord(_request(0), "OK", True, False, (1, 2)),
        "soak-1": RequestRecord(_request(1), "OK", True, False, (1, 2)),
        "soak-2": RequestRecord(_request(2), "OK", True, False, (4, 5)),
        "soak-6": RequestRecord(_request(6), "OK", True, False, (9, 8, 9)),  # differs at token 1
        "soak-7": RequestRecord(_request(7), "UNAVAILABLE", True, False, message="replay broke"),
    }
    kills = (KillRecord("prefill-0", 3, 1.0, "old", 4.0), KillRecord("generation-1", 6, 9.0, "old", None))
    report = build_report(
        config, records, replayed,
        leaked_blocks=0, illegal_transitions=0, transfer_counters={"failed_INCOMPLETE": 1}, planned={"soak-2": ("corrupt@sender",)},
        kills=kills, unhealthy=(), duration_s=10.0, replay_duration_s=2.0,
    )
    return report


def test_the_report_counts_each_outcome_once() -> None:
    report = _mixed_report()
    assert (report.requests, report.accepted, report.completed) == (8, 7, 5)
    assert report.failed_by_status == {"UNAVAILABLE": 1}
    assert report.rejected_by_status == {"RESOURCE_EXHAUSTED": 1}
    assert (report.lost, report.lost_ids) == (1, ("soak-4",))
    assert report.token_mismatches == 2
    assert {(m.client_request_id, m.first_difference) for m in report.mismatches} == {("soak-6", 1), ("soak-7", -1)}
    assert report.recovered == 2  # soak-2 (three hops, attempt 2) and soak-6 (recompute)
    assert report.recoveries_by_action == {"retry_transfer": 1, "recompute_local": 1, "fail": 1}
    assert report.recoveries_by_cause == {"checksum_mismatch": 1, "instance_died": 1, "incomplete": 1}
    assert report.kills_recovered == 1
    assert report.planned_faults == {"corrupt@sender": 1}
    assert not report.ok
    # Extra latency against the median of the non-recovered completions of the same bucket (1, 3, 1.5 s).
    assert report.extra_latency_p50_s == pytest.approx(0.5) and report.extra_latency_p99_s == pytest.approx(3.0)
    line = json.loads(report.json_line())
    assert line["targets"]["lost"] == {"value": 1, "target": 0, "met": False}
    assert line["targets"]["leaked_blocks"] == {"value": 0, "target": 0, "met": True}
    table = report.table()
    assert "FAIL: lost=1, token_mismatches=2" in table and "soak-6 at token 1" in table


def test_extra_latency_is_against_the_same_max_tokens_bucket() -> None:
    records = [
        RequestRecord(_request(0, max_tokens=4), "OK", True, False, (1,), 1.0, PD),
        RequestRecord(_request(1, max_tokens=32), "OK", True, False, (1,), 10.0, PD),
        RequestRecord(_request(2, max_tokens=32), "OK", True, False, (1,), 12.0, _hops(("prefill", 1), ("generation", 2))),
        RequestRecord(_request(3, max_tokens=4), "OK", True, False, (1,), 1.5, _hops(("prefill", 2), ("generation", 1))),
        RequestRecord(_request(4, max_tokens=8), "OK", True, False, (1,), 9.0, _hops(("recompute", 1))),  # no baseline
    ]
    assert sorted(extra_latencies(records)) == pytest.approx([0.5, 2.0])


def test_recovery_details_are_read_from_the_router_timeline() -> None:
    assert recovery_cause("KV transfer failed: RESERVATION_EXPIRED: lapsed") == "reservation_expired"
    assert recovery_cause("instance prefill-1 died: silent for 3.4s") == "instance_died"
    assert recovery_cause("GENERATION_INIT exceeded its 10.0s stage timeout") == "stage_timeout"
    assert recovery_cause("prefill-0 unavailable: prefill-0: ActorUnavailableError") == "instance_unavailable"
    timeline = _timeline(
        ("CONTEXT_WAIT", "kv_aware: cost 3"),
        ("CONTEXT_WAIT", "re-run prefill (KV transfer failed: PEER_UNAVAILABLE: closed)"),
        ("CONTEXT_WAIT", "re-run colocated (instance generation-0 died: restarted)"),
        ("COMPLETE", "length"),
    )
    assert timeline_recoveries(timeline) == [("reprefill_elsewhere", "peer_unavailable"), ("reprefill_elsewhere", "instance_died")]


def test_the_command_exits_non_zero_when_an_invariant_broke(monkeypatch, capsys) -> None:
    import cluster.loadgen.chaos

    monkeypatch.setattr(cluster.loadgen.chaos, "run_soak", lambda config, show_progress: _mixed_report())
    assert main(["--requests", "8", "--no-progress"]) == EXIT_INVARIANT_BROKEN
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["targets"]["token_mismatches"]["met"] is False
    assert any(line.startswith("FAIL:") for line in out)


# ---- regressions the soak found ----------------------------------------------------------------


def test_reprefill_elsewhere_without_another_prefill_instance_falls_through_to_recompute() -> None:
    """Found by the soak (seed 12, while prefill-0 was down after a kill): a request whose transfer
    failed twice (the retry used up) was failed with UNAVAILABLE "re-placement failed: no prefill
    instance available", although RECOMPUTE_LOCAL, next in the chain, could serve it. The router
    counted REPREFILL_ELSEWHERE as applicable because the request's own prefill instance was
    healthy, and then excluded exactly that instance when re-placing. In process, no Ray: one
    PREFILL instance (so no other to re-run on) and a receiver that refuses both transfers."""
    import asyncio

    from local_cluster import collect

    from cluster.router.api import ClientRequest, FinalEvent, Outcome
    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import LocalInstanceClient
    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.sampling import SamplingParams
    from worker.tokenizer import ByteTokenizer

    token = "soak-regression-token-0123456789abcdef"
    refuse = {"enabled": True, "seed": 1, "rules": [{"kind": "refuse", "side": "receiver", "request_ids": ["r.g1", "r.g2"]}]}
    config = RouterConfig.from_dict(
        {
            "health": {"heartbeat_interval_s": 0.2, "dead_after_s": 1.5},
            "timeouts": {"context_s": 30.0, "reservation_s": 10.0, "transfer_s": 10.0, "generation_s": 30.0},
            "recovery": {
                "chain": [
                    {"action": "retry_transfer", "max_attempts": 1},
                    {"action": "reprefill_elsewhere", "max_attempts": 1},
                    {"action": "recompute_local", "max_attempts": 1},
                    {"action": "fail", "max_attempts": 1},
                ]
            },
        }
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = (256, *range(40, 80))

    def instance(name: str, role: InstanceRole, faults=None) -> Instance:
        engine = EngineConfig(role=role, num_blocks=64, tokens_per_block=16)
        return Instance(InstanceSpec(name, engine, dtype="float32", device="cpu", cluster_token=token, torch_threads=1, faults=faults))

    async def scenario() -> tuple[list[int], FinalEvent]:
        instances = [instance("p0", InstanceRole.PREFILL), instance("g0", InstanceRole.GENERATION, refuse)]
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=5)
        await router.start()
        try:
            for item in instances:
                await router.add_instance(LocalInstanceClient(item))
            return await collect(await router.submit(ClientRequest(None, prompt, params, client_request_id="r")))
        finally:
            await router.stop()
            for item in instances:
                item.shutdown()

    tokens, final = asyncio.run(scenario())
    assert final.outcome is Outcome.COMPLETE, final.error_message
    assert [(use.phase, use.instance_id) for use in final.instances][-1] == ("recompute", "g0")
    assert len(tokens) == 8


def test_a_late_push_failure_report_from_the_sender_is_consistent_with_the_retried_transfer() -> None:
    """Found by the soak (seed 11, under load): the receiver reported a corrupt transfer first; the
    router retried, the retry committed (GENERATING); then the sender's own "push failed" record,
    made in DISAGG_CONTEXT_TRANS_IN_PROGRESS (where it stays until the retried push is
    acknowledged), arrived and was counted as an inconsistent report. The sender really is in that
    state while the receiver generates; the router's check must accept it."""
    from cluster.router.state import (
        TRANSITIONS,
        GlobalState,
        RequestTimeline,
        Route,
        global_states_for_local,
    )
    from worker.protocol import RequestType as LocalRequestType

    timeline = RequestTimeline("r", clock=lambda: 0.0)
    for state in (
        GlobalState.CONTEXT_WAIT, GlobalState.CONTEXT_IN_PROGRESS, GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION,
        GlobalState.GENERATION_INIT, GlobalState.TRANSMISSION, GlobalState.GENERATING,
    ):
        timeline.transition(state, route=Route.DISAGGREGATED if state is GlobalState.CONTEXT_WAIT else None)
    allowed = global_states_for_local("DISAGG_CONTEXT_TRANS_IN_PROGRESS", InstanceRole.PREFILL, LocalRequestType.CONTEXT_ONLY)
    reachable = {target[0] for target in TRANSITIONS.get(timeline.node, frozenset())}
    # The router's rule (Router._check_consistency).
    assert timeline.state in allowed or allowed & reachable, (timeline.state, allowed)


def test_an_exception_while_handling_a_poll_batch_does_not_stop_polling_that_instance() -> None:
    """Found by the soak (seed 11, under load, not reproduced on demand): generation-1 stopped being
    polled (its actor saw ~7 calls/s, then none for minutes while alive) and stayed HEALTHY, so
    requests kept being placed there and hung in GENERATION_INIT / GENERATING until their stage
    timeouts failed them. Router._poll_loop guards the poll call but not `_on_batch`: any exception
    while handling a batch (an IllegalTransition from a race, say) ends the poll task silently. Here
    one handling error is injected; polling must go on."""
    import asyncio

    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import LocalInstanceClient
    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.tokenizer import ByteTokenizer

    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 1.0}})
    engine = EngineConfig(role=InstanceRole.MIXED, num_blocks=16, tokens_per_block=16)
    instance = Instance(InstanceSpec("m0", engine, dtype="float32", device="cpu", cluster_token="t" * 32, torch_threads=1))
    polls = 0

    class CountingClient(LocalInstanceClient):
        async def poll(self, timeout_s: float):
            nonlocal polls
            polls += 1
            return await super().poll(timeout_s)

    async def scenario() -> tuple[int, bool]:
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
        original = router._prefix_snapshot
        failures = iter([RuntimeError("injected: a bug while handling one batch")])

        def flaky(*args, **kwargs):
            error = next(failures, None)
            if error is not None:
                raise error
            return original(*args, **kwargs)

        router._prefix_snapshot = flaky  # called for every batch that carries a load report
        await router.start()
        try:
            await router.add_instance(CountingClient(instance))
            await asyncio.sleep(0.5)
            before = polls
            await asyncio.sleep(0.5)
            return polls - before, router.instances["m0"].task.done()
        finally:
            await router.stop()

    try:
        later_polls, task_done = asyncio.run(scenario())
    finally:
        instance.shutdown()
    assert not task_done, "the poll task of m0 ended"
    assert later_polls >= 3, later_polls


async def _until(predicate, what: str, timeout_s: float = 3.0) -> None:
    """Wait on the router's loop until `predicate()` holds (scripted-instance scenarios)."""
    import asyncio

    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _started_router(config, *instances):
    """A started Router (the byte tokenizer, a seed) with the scripted instances added."""
    import asyncio

    from cluster.router.driver import Router
    from worker.tokenizer import ByteTokenizer

    router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
    await router.start()
    for instance in instances:
        instance.batches = asyncio.Queue()
        await router.add_instance(instance)
    return router


async def _to_the_push(router, prefill, generation):
    """Submit request "r" (3 greedy tokens) and script it to its KV push: p0 computes the context,
    g0 reserves, the router asks p0 to push. Returns the request's handle."""
    from cluster.router.api import ClientRequest
    from worker.protocol import RequestOutput, ReservationNotice
    from worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    handle = await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="r"))
    await _until(lambda: ("submit", "r.p1") in prefill.calls, "the prefill hop")
    prefill.feed(outputs=(RequestOutput("r.p1", (10,), "", context_done=True),))
    await _until(lambda: ("submit", "r.g1") in generation.calls, "the generation hop")
    generation.feed(reservations=(ReservationNotice("r.g1", "t-1", 1, 1e12),))
    await _until(lambda: ("push", "r.p1") in prefill.calls, "the push")
    return handle


class _ScriptedInstance:
    """An InstanceClient whose poll batches the test hands it, recording every call (no engine)."""

    def __init__(self, instance_id: str, role: InstanceRole) -> None:
        from worker.kv_layout import KvLayout
        from worker.protocol import InstanceInfo

        layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32", model_fingerprint="fp")
        self.instance_id = instance_id
        self.info = InstanceInfo(instance_id, role, "inc-1", f"127.0.0.1:{7000 + len(instance_id)}", layout, 64, 264, 4096, 1, "cpu")
        self.calls: list[tuple[str, str]] = []
        self.batches = None  # an asyncio.Queue, made on the router's loop
        self.abort_gate = None  # an asyncio.Event: aborts wait for it (a slow instance)
        self.submit_gate = None  # likewise for submits
        self._sequence = 0

    def feed(self, **parts) -> None:
        from worker.protocol import PollBatch

        self._sequence += 1
        self.batches.put_nowait(PollBatch(incarnation="inc-1", sequence=self._sequence, **parts))

    async def get_info(self):
        return self.info

    async def ping(self) -> str:
        return "inc-1"

    async def poll(self, timeout_s: float):
        import asyncio

        from worker.protocol import PollBatch

        try:
            return await asyncio.wait_for(self.batches.get(), timeout_s)
        except asyncio.TimeoutError:
            self._sequence += 1
            return PollBatch(incarnation="inc-1", sequence=self._sequence)

    async def submit(self, request) -> None:
        self.calls.append(("submit", request.request_id))
        if self.submit_gate is not None:
            await self.submit_gate.wait()

    async def abort(self, request_id: str, detail: str) -> None:
        self.calls.append(("abort", request_id))
        if self.abort_gate is not None:
            await self.abort_gate.wait()

    async def release(self, request_id: str, reason, detail: str) -> None:
        self.calls.append(("release", request_id))

    async def push(self, request_id, target, transfer_id, deadline_s, target_request_id) -> None:
        self.calls.append(("push", request_id))

    async def drain(self, timeout_s: float) -> int:
        return 0


def test_a_push_that_fails_after_the_receiver_committed_does_not_undo_the_hand_over() -> None:
    """Found by the soak (3 soaks at once, load ~20 on 2 cores): a sender's push lost its shared
    connection ("Channel closed!") after the receiver had committed the KV; the router, already in
    GENERATING, took the late failure for a transfer failure, aborted the healthy generation hop and
    tried GENERATING -> GENERATION_INIT (an IllegalTransition, raised into the prefill instance's
    poll loop). Scripted instances make the order of reports exact: commit first, then the failed
    push result. The hand-over must stand: no abort on the generation instance, the request
    completes there, and the sender's copy is freed."""
    import asyncio

    from cluster.router.api import FinalEvent, Outcome
    from cluster.router.config import RouterConfig
    from worker.protocol import PushResult, RequestOutput, StateEvent
    from worker.stopping import FinishReason

    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}})
    prefill, generation = _ScriptedInstance("p0", InstanceRole.PREFILL), _ScriptedInstance("g0", InstanceRole.GENERATION)

    async def scenario() -> tuple[FinalEvent, str, int]:
        router = await _started_router(config, prefill, generation)
        try:
            handle = await _to_the_push(router, prefill, generation)
            generation.feed(events=(StateEvent("r.g1", "DISAGG_GENERATION_TRANS_COMPLETE", 0.0, "KV received"),))
            await _until(lambda: router.get_request("r").state == "GENERATING", "GENERATING")
            # The sender's connection broke after the commit: its push result says failed.
            prefill.feed(push_results=(PushResult("r.p1", "t-1", False, "PEER_UNAVAILABLE", "Channel closed!", 0, 0.0),))
            await asyncio.sleep(0.3)
            generation.feed(
                outputs=(RequestOutput("r.g1", (11, 12), "", finished=True, finish_reason=FinishReason.LENGTH),)
            )


            async def final_event() -> FinalEvent:
                async for event in handle.events():
                    if isinstance(event, FinalEvent):
                        return event
                raise AssertionError("the stream ended without a final event")

            try:
                final = await asyncio.wait_for(final_event(), 10.0)
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"no final event: the request is stuck in {router.get_request('r').state}; "
                    f"illegal transitions {router.illegal_transitions}; calls to g0 {generation.calls}"
                ) from None
            return final, router.get_request("r").state, router.illegal_transitions
        finally:
            await router.stop()

    final, state, illegal = asyncio.run(scenario())
    assert illegal == 0
    assert ("abort", "r.g1") not in generation.calls, generation.calls
    assert (final.outcome, state) == (Outcome.COMPLETE, "COMPLETE"), final.error_message
    assert [(use.phase, use.instance_id) for use in final.instances] == [("prefill", "p0"), ("generation", "g0")]
    assert ("abort", "r.p1") in prefill.calls  # the sender's copy is freed


def test_one_failure_gets_one_recovery_even_when_the_instance_is_slow_to_answer() -> None:
    """Found by the soak (an IllegalTransition CONTEXT_IN_PROGRESS[DISAGGREGATED] ->
    GENERATING[DISAGGREGATED] under load; the trace was lost, this is the mechanism it points to):
    recovery awaits calls to instances (abort, release, submit) between choosing an action and
    making its transition, and nothing stops a second recovery of the same request meanwhile. Here
    the generation instance is slow to answer the abort of a failed transfer, the stage timeout
    passes, and the watchdog starts a second recovery (RECOMPUTE_LOCAL, GENERATING[COLOCATED]);
    when the first one resumes it makes GENERATING[COLOCATED] -> GENERATION_INIT, illegal, and the
    request has two live hops. One failure must get one recovery."""
    import asyncio

    from cluster.router.config import RouterConfig
    from worker.protocol import PushResult

    config = RouterConfig.from_dict(
        {
            "health": {"heartbeat_interval_s": 0.05, "dead_after_s": 0.4},
            "timeouts": {"context_s": 30.0, "reservation_s": 30.0, "transfer_s": 0.5, "generation_s": 30.0},
        }
    )
    prefill, generation = _ScriptedInstance("p0", InstanceRole.PREFILL), _ScriptedInstance("g0", InstanceRole.GENERATION)

    async def scenario() -> tuple[int, dict, list]:
        router = await _started_router(config, prefill, generation)
        try:
            await _to_the_push(router, prefill, generation)
            generation.abort_gate = asyncio.Event()  # g0 is slow to answer from now on
            prefill.feed(push_results=(PushResult("r.p1", "t-1", False, "CHECKSUM_MISMATCH", "chunk 0", 0, 0.0),))
            await _until(lambda: ("abort", "r.g1") in generation.calls, "the first recovery's abort")
            await asyncio.sleep(1.5)  # the TRANSMISSION stage timeout (0.5 s) passes meanwhile
            generation.abort_gate.set()
            await asyncio.sleep(0.5)
            actions = {action.value: count for action, count in router.recovery_actions.items()}
            hops = [c for c in prefill.calls + generation.calls if c[0] == "submit"]
            return router.illegal_transitions, actions, hops
        finally:
            generation.abort_gate.set()
            await router.stop()

    illegal, actions, hops = asyncio.run(scenario())
    assert illegal == 0, (actions, hops)
    assert sum(actions.values()) == 1, (actions, hops)


def test_a_failure_reported_while_a_recovery_runs_is_acted_on_after_it() -> None:
    """The other half of one-recovery-at-a-time: a failure of one of the request's current hops
    reported by another instance while a recovery runs is neither acted on concurrently nor
    dropped. Here g0 reports the KV transfer failed (recovery 1: retry the transfer, its submit
    to g0 slow); meanwhile p0 reports it lost the prefill KV; once recovery 1 is done, recovery 2
    finds no KV to retry from and no other prefill instance, and recomputes on g0."""
    import asyncio

    from cluster.router.api import Outcome
    from cluster.router.config import RouterConfig
    from worker.protocol import ErrorCode, RequestError, RequestOutput
    from worker.stopping import FinishReason

    config = RouterConfig.from_dict({"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}})
    prefill, generation = _ScriptedInstance("p0", InstanceRole.PREFILL), _ScriptedInstance("g0", InstanceRole.GENERATION)

    async def scenario():
        router = await _started_router(config, prefill, generation)
        try:
            handle = await _to_the_push(router, prefill, generation)
            generation.submit_gate = asyncio.Event()  # recovery 1's new hop is slow to submit
            failed = RequestError(ErrorCode.TRANSFER_FAILED, "chunk 0", "CHECKSUM_MISMATCH")
            generation.feed(outputs=(RequestOutput("r.g1", (), "", finished=True, error=failed),))
            await _until(lambda: ("submit", "r.g2") in generation.calls, "recovery 1 (retry the transfer)")
            lost = RequestError(ErrorCode.LEASE_EXPIRED, "the KV is gone")
            prefill.feed(outputs=(RequestOutput("r.p1", (), "", finished=True, error=lost),))
            await asyncio.sleep(0.3)
            during = sum(router.recovery_actions.values())
            generation.submit_gate.set()
            await _until(lambda: ("submit", "r.c1") in generation.calls, "recovery 2 (recompute on g0)")
            generation.feed(outputs=(RequestOutput("r.c1", (11, 12), "", finished=True, finish_reason=FinishReason.LENGTH),))
            final = None
            async for event in handle.events():
                final = event
            actions = {action.value: count for action, count in router.recovery_actions.items()}
            return during, actions, final, router.illegal_transitions
        finally:
            generation.submit_gate.set()
            await router.stop()

    during, actions, final, illegal = asyncio.run(scenario())
    assert during == 1  # p0's report waited for recovery 1
    assert actions == {"retry_transfer": 1, "recompute_local": 1}
    assert illegal == 0
    assert final.outcome is Outcome.COMPLETE, final
    assert ("abort", "r.g2") in generation.calls  # the retried hop was stopped before recomputing


def test_a_client_request_id_used_again_gets_fresh_hop_ids() -> None:
    """A client may name a new request like one that ended. The old hop may still be ending on the
    instance (its abort on the way, its last report not yet read): the new request's hops must not
    share its engine ids, or the instance refuses the new hop as a duplicate and the old hop's late
    ABORTED report is taken for the new request's (which then waits for nothing)."""
    import asyncio

    from cluster.router.api import ClientRequest, Outcome
    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from worker.protocol import ErrorCode, RequestError, RequestOutput
    from worker.sampling import SamplingParams
    from worker.stopping import FinishReason
    from worker.tokenizer import ByteTokenizer

    config = RouterConfig.from_dict(
        {"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}, "placement": {"disaggregation": "never"}}
    )
    mixed = _ScriptedInstance("m0", InstanceRole.MIXED)

    async def scenario():
        mixed.batches = asyncio.Queue()
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
        await router.start()
        try:
            await router.add_instance(mixed)
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            await router.submit(ClientRequest(None, (256, 1, 2, 3), params, client_request_id="r"))
            await _until(lambda: ("submit", "r.c1") in mixed.calls, f"the first request's hop: {mixed.calls}")
            await router.abort(client_request_id="r")
            handle = await router.submit(ClientRequest(None, (256, 4, 5, 6), params, client_request_id="r"))
            await _until(lambda: ("submit", "r.c2") in mixed.calls, "the second request's hop")
            # The old hop's last report arrives late, then the new hop finishes.
            aborted = RequestError(ErrorCode.ABORTED, "request ended")
            mixed.feed(outputs=(RequestOutput("r.c1", (), "", finished=True, error=aborted),))
            mixed.feed(outputs=(RequestOutput("r.c2", (7, 8), "", finished=True, finish_reason=FinishReason.LENGTH),))
            events = [event async for event in handle.events()]
            return events, router.illegal_transitions
        finally:
            await router.stop()

    events, illegal = asyncio.run(scenario())
    final = events[-1]
    assert final.outcome is Outcome.COMPLETE, final
    assert [use.attempt for use in final.instances] == [2]
    assert illegal == 0
    assert [c for c in mixed.calls if c[0] == "submit"] == [("submit", "r.c1"), ("submit", "r.c2")]
