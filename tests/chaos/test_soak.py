"""The chaos soak, short (CI) version, through `duet chaos` itself: a few hundred requests against
2 PREFILL + 2 GENERATION with faults on about 15 % of the KV transfers and two instance kills; lost
requests, leaked blocks, token mismatches against the fault-free replay and illegal transitions must
all be 0, and the faults and kills must really have happened. The note reports a full run
(`duet chaos`, 1,000 requests).

Also, without a cluster: the soak's building blocks (workload, plan, kills, report arithmetic).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from cluster.cli.chaos import EXIT_INVARIANT_BROKEN, add_parser, main
from cluster.client import InstanceWork, StateChange
from cluster.loadgen.chaos_plan import (
    FAULT_KINDS,
    SoakConfig,
    SoakConfigError,
    SoakRequest,
    fault_plan,
    faulty_cluster_config,
    kill_schedule,
    make_requests,
    planned_faults,
    replay_cluster_config,
)
from cluster.loadgen.chaos_report import (
    MUST_BE_ZERO,
    KillRecord,
    build_report,
    extra_latencies,
    extra_latency_by_first_cause,
    recovered_extras,
    recovery_cause,
    slowest_recoveries,
    timeline_recoveries,
)
from cluster.loadgen.metrics import RequestRecord
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
            # One host: the bytes go through shared memory (tests/chaos/test_faults.py runs both planes).
            "--data-plane", "shm",
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
    assert figures["data_plane"] == "shm" and figures["shm_segments_left"] == 0  # killed senders' segments swept
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


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["generation", "prefill"])
def test_killing_the_only_instance_of_a_role_loses_nothing_and_fails_nothing(ray_cluster, capsys, role) -> None:
    """1 PREFILL + 1 GENERATION, 20 requests in flight, the only instance of `role` SIGKILLed: the
    requests in flight and those sent while Ray restarts it all complete, with the tokens of the
    fault-free replay (no failure at all, not only nothing lost)."""
    requests = 60
    status = main(
        [
            "--requests", str(requests), "--seed", "5", "--fault-rate", "0", "--kill-every", "40",
            "--prefill", "1", "--generation", "1", "--concurrency", "20", "--kill-only-role", role, "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    figures, targets = result["figures"], result["targets"]
    assert {name: targets[name]["value"] for name in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), out
    assert status == 0, out
    assert figures["kill_only_role"] == role
    assert figures["kills"] == figures["kills_recovered"] == 1, figures
    assert figures["completed"] == requests and figures["failed_by_status"] == {}, figures


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
    roles = {i: i.split("-")[0] for i in ids}
    only = kill_schedule(SoakConfig(requests=1000, seed=2, kill_every=100, kill_role="generation"), ids, roles)
    assert len(only) == 9 and {k.instance_id for k in only} <= {"generation-0", "generation-1"}
    with pytest.raises(SoakConfigError):
        kill_schedule(SoakConfig(requests=1000, kill_every=100, kill_role="prefill"), ["generation-0"], {"generation-0": "generation"})


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

    # Tokens grouped on the faulty side only: the replay reports every step, and nothing else differs.
    grouped = faulty_cluster_config(dataclasses.replace(config, stream_interval_ms=20.0))
    assert grouped.engine == {**faulty.engine, "stream_interval_ms": 20.0}
    assert all(grouped.engine_config(g).stream_interval_ms == 20.0 for g in grouped.instances)
    assert "stream_interval_ms" not in replay_cluster_config(dataclasses.replace(config, stream_interval_ms=20.0)).engine


@pytest.mark.parametrize(
    ("field", "value"),
    [("requests", 0), ("fault_rate", 1.5), ("fault_rate", float("nan")), ("kill_every", -1), ("concurrency", 0), ("lost_after_s", 0.0),
     ("stream_interval_ms", -1.0), ("stream_interval_ms", float("inf"))],
)
def test_bad_settings_name_their_field(field, value) -> None:
    with pytest.raises(SoakConfigError) as error:
        SoakConfig(**{field: value})
    assert error.value.field == field


def test_the_command_line_refuses_bad_values_with_exit_status_2(capsys) -> None:
    assert main(["--fault-rate", "2"]) == 2
    assert "--fault-rate" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="duet")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--requests", "7", "--kill-every", "0", "--address", "ray://head:10001"])
    assert (args.requests, args.kill_every, args.address, args.fault_rate) == (7, 0, "ray://head:10001", 0.05)
    assert args.stream_interval_ms == 0.0
    assert main(["--stream-interval-ms", "-5"]) == 2
    assert "--stream-interval" in capsys.readouterr().err
    assert callable(args.handler)


def _request(index: int, max_tokens: int = 8) -> SoakRequest:
    return SoakRequest(index, (1, 2, 3), max_tokens, 0.0, 1.0, 5)


def _record(
    request: SoakRequest, status: str, accepted: bool, lost: bool, token_ids: tuple[int, ...] = (), latency_s: float = 0.0,
    instances: tuple[InstanceWork, ...] = (), timeline: tuple[StateChange, ...] = (), message: str = "",
) -> RequestRecord:
    """How the soak records a request that ended with `status` after `latency_s` (cluster/loadgen/chaos.py, run_request)."""
    return RequestRecord(
        index=request.index, sent_s=0.0, end_s=latency_s, expected_output_tokens=request.max_tokens, instances=instances,
        error=None if status == "OK" else f"{status}: {message}", accepted=accepted, lost=lost, token_ids=token_ids,
        timeline=timeline,
    )


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
        _record(_request(0), "OK", True, False, (1, 2), 1.0, PD),
        _record(_request(1), "OK", True, False, (1, 2), 3.0, PD),
        _record(_request(2), "OK", True, False, (4, 5), 4.5, _hops(("prefill", 1), ("generation", 1), ("generation", 2)), retried),
        _record(_request(3), "UNAVAILABLE", True, False, (), 2.0, PD, exhausted, "recovery exhausted"),
        _record(_request(4), "DEADLINE_EXCEEDED", True, True, (), 300.0),
        _record(_request(5), "RESOURCE_EXHAUSTED", False, False),
        _record(_request(6), "OK", True, False, (9, 9, 9), 2.0, _hops(("prefill", 1), ("recompute", 1))),
        _record(_request(7), "OK", True, False, (7,), 1.5, PD),
    ]
    replayed = {
        "soak-0": _record(_request(0), "OK", True, False, (1, 2)),
        "soak-1": _record(_request(1), "OK", True, False, (1, 2)),
        "soak-2": _record(_request(2), "OK", True, False, (4, 5)),
        "soak-6": _record(_request(6), "OK", True, False, (9, 8, 9)),  # differs at token 1
        "soak-7": _record(_request(7), "UNAVAILABLE", True, False, message="replay broke"),
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
        _record(_request(0, max_tokens=4), "OK", True, False, (1,), 1.0, PD),
        _record(_request(1, max_tokens=32), "OK", True, False, (1,), 10.0, PD),
        _record(_request(2, max_tokens=32), "OK", True, False, (1,), 12.0, _hops(("prefill", 1), ("generation", 2))),
        _record(_request(3, max_tokens=4), "OK", True, False, (1,), 1.5, _hops(("prefill", 2), ("generation", 1))),
        _record(_request(4, max_tokens=8), "OK", True, False, (1,), 9.0, _hops(("recompute", 1))),  # no baseline
    ]
    assert sorted(extra_latencies(records)) == pytest.approx([0.5, 2.0])


def test_the_slowest_recoveries_show_where_their_time_went() -> None:
    died = (
        StateChange("CONTEXT_WAIT", 100.0, "", "kv_aware: cost 3"),
        StateChange("QUEUED", 100.25, "", "waiting up to 60s for a healthy instance (instance prefill-0 died: restarted)"),
        StateChange("COMPLETE", 102.0, "", "length"),
    )
    expired = _timeline(("GENERATION_INIT", "retry transfer (KV transfer failed: RESERVATION_EXPIRED: lapsed)"))
    records = [
        _record(_request(0), "OK", True, False, (1,), 1.0, PD),
        _record(_request(1), "OK", True, False, (1,), 4.0, _hops(("prefill", 1), ("prefill", 2), ("generation", 1)), died),
        _record(_request(2), "OK", True, False, (1,), 1.5, _hops(("prefill", 1), ("generation", 2)), expired),
    ]
    extras = recovered_extras(records)
    slowest = slowest_recoveries(extras, count=1)
    assert [(slow.client_request_id, slow.extra_latency_s) for slow in slowest] == [("soak-1", pytest.approx(3.0))]
    assert slowest[0].recoveries == (("wait_for_instance", "instance_died"),)
    assert slowest[0].timeline == (
        "CONTEXT_WAIT +0 kv_aware: cost 3 | QUEUED +250 waiting up to 60s for a healthy instance (instance prefill-0 died: restarted) | COMPLETE +2000 length"
    )
    by_cause = extra_latency_by_first_cause(extras)
    assert by_cause == {
        "instance_died": {"count": 1, "p50_s": 3.0, "p95_s": 3.0},
        "reservation_expired": {"count": 1, "p50_s": 0.5, "p95_s": 0.5},
    }


def test_recovery_details_are_read_from_the_router_timeline() -> None:
    assert recovery_cause("KV transfer failed: RESERVATION_EXPIRED: lapsed") == "reservation_expired"
    assert recovery_cause("instance prefill-1 died: silent for 3.4s") == "instance_died"
    assert recovery_cause("GENERATION_INIT exceeded its 10.0s stage timeout") == "stage_timeout"
    assert recovery_cause("prefill-0 unavailable: prefill-0: ActorUnavailableError") == "instance_unavailable"
    assert recovery_cause("waiting up to 60s for a healthy instance (no generation instance for the hand-over)") == "no_instance"
    timeline = _timeline(
        ("CONTEXT_WAIT", "kv_aware: cost 3"),
        ("CONTEXT_WAIT", "re-run prefill (KV transfer failed: PEER_UNAVAILABLE: closed)"),
        ("CONTEXT_WAIT", "re-run colocated (instance generation-0 died: restarted)"),
        ("GENERATION_INIT", "first token; retry transfer (the early reservation was lost: generation-1 unavailable: gone): reserving KV"),
        ("GENERATION_INIT", "first token; reserving KV"),
        ("CONTEXT_WAIT", "re-run prefill (reservation made but the prefill KV is gone)"),
        ("COMPLETE", "length"),
    )
    assert timeline_recoveries(timeline) == [
        ("reprefill_elsewhere", "peer_unavailable"),
        ("reprefill_elsewhere", "instance_died"),
        ("retry_transfer", "instance_unavailable"),
        ("reprefill_elsewhere", "kv_lost"),
    ]


def test_the_command_exits_non_zero_when_an_invariant_broke(monkeypatch, capsys) -> None:
    import cluster.loadgen.chaos

    monkeypatch.setattr(cluster.loadgen.chaos, "run_soak", lambda config, show_progress: _mixed_report())
    assert main(["--requests", "8", "--no-progress"]) == EXIT_INVARIANT_BROKEN
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["targets"]["token_mismatches"]["met"] is False
    assert any(line.startswith("FAIL:") for line in out)
