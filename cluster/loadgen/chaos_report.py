"""The chaos soak's report (cluster/loadgen/chaos.py runs the soak): what its request records, its
replay on the clean cluster and the routers' counters add up to. Pure: tests feed it records.

What the report counts (`SoakReport`):

- accepted: requests the router admitted (it knows them by id); rejected ones are listed by status.
- completed; failed by status (gRPC code names): accepted requests that ended with a status the
  cluster sent (e.g. UNAVAILABLE when recovery was exhausted). Those are neither lost nor
  mismatches.
- lost: accepted requests without a final event within `lost_after_s`. The soak sets no request
  timeout, so the call's deadline is that bound; a DEADLINE_EXCEEDED therefore means the bound
  passed (whether the router or the client noticed first), and counts as lost. A stream that ends
  without a result is lost too.
- leaked blocks: after settling, the sum over instances of total - free blocks.
- token mismatches: completed requests whose tokens differ from the replay's (a replay that
  fails counts as a mismatch: the request could not be verified).
- illegal transitions: the routers' illegal_transitions + inconsistent_reports.
- recovered: completed requests with more than two hops, a "recompute" hop or an attempt > 1.
- extra latency of recovered requests: each one's end-to-end latency minus the median latency of
  the requests that completed without recovery in the same max_tokens bucket (powers of two), in
  this run; p50 and p99 by nearest rank (cluster/loadgen/metrics.py). (The replay's own latency is
  not comparable: another cluster, another load.)
- faults that fired: the recoveries in the timelines, by cause ("checksum_mismatch",
  "instance_died", ...) and by action, the routers' transfer failure counters, and the kills.
  Faults that need no recovery (delay, duplicate, reorder) leave no trace in a timeline; the
  planned ones are listed.

The requests are loadgen's RequestRecords (cluster/loadgen/metrics.py) with the soak's fields:
`index` is the soak request's, `expected_output_tokens` its max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.client import StateChange
from cluster.loadgen.chaos_plan import SoakConfig, soak_request_id
from cluster.loadgen.metrics import PercentileMethod, RequestRecord, percentile

BENCH_NAME = "chaos_soak"
MUST_BE_ZERO = ("lost", "leaked_blocks", "token_mismatches", "illegal_transitions", "shm_segments_left")


@dataclass(frozen=True)
class KillRecord:
    instance_id: str
    after_request: int
    killed_at_s: float  # since the soak's requests started
    old_incarnation: str
    back_after_s: float | None  # until the router saw a new incarnation HEALTHY; None: not seen


_CAUSES = (
    (re.compile(r"KV transfer failed: ([A-Za-z_]+):"), None),
    (re.compile(r"died"), "instance_died"),
    (re.compile(r"restarted"), "instance_died"),
    (re.compile(r"exceeded its"), "stage_timeout"),
    (re.compile(r"unavailable"), "instance_unavailable"),
    (re.compile(r"no (healthy |prefill |generation )*instance"), "no_instance"),
    (re.compile(r"prefill KV is gone"), "kv_lost"),
)
_FIRST_TOKEN = "first token; "
_ACTIONS = (
    ("retry transfer", "retry_transfer"),
    ("re-run prefill", "reprefill_elsewhere"),
    ("re-run colocated", "reprefill_elsewhere"),
    ("recompute locally", "recompute_local"),
    ("waiting up to", "wait_for_instance"),
)


def recovery_cause(detail: str) -> str:
    """What a recovery entry's detail says went wrong ("checksum_mismatch", "instance_died", ...)."""
    for pattern, name in _CAUSES:
        match = pattern.search(detail)
        if match:
            return name or match.group(1).lower()
    return "other"


def timeline_recoveries(timeline: Sequence[StateChange]) -> list[tuple[str, str]]:
    """(action, cause) of every recovery step in a request's timeline, and ("fail", cause) when
    recovery gave up."""
    found = []
    for entry in timeline:
        # A hand-over retried at context done after its early reservation was lost reads
        # "first token; retry transfer (...)": the step follows the first token's note.
        detail = entry.detail.removeprefix(_FIRST_TOKEN)
        for prefix, action in _ACTIONS:
            if detail.startswith(prefix):
                found.append((action, recovery_cause(entry.detail)))
                break
        else:
            if entry.state == "ERROR" and "recovery exhausted" in entry.detail:
                found.append(("fail", recovery_cause(entry.detail)))
    return found


def was_recovered(record: RequestRecord) -> bool:
    """More than two hops, a "recompute" hop or an attempt > 1: the cluster recovered something."""
    return len(record.instances) > 2 or any(work.phase == "recompute" or work.attempt > 1 for work in record.instances)


def _extra_latency_percentile(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q, PercentileMethod.NEAREST_RANK) if values else None


def _bucket(max_tokens: int) -> int:
    return max(0, math.ceil(math.log2(max_tokens)))


def recovered_extras(records: Sequence[RequestRecord]) -> list[tuple[RequestRecord, float]]:
    """Each recovered completed request with its extra latency: its latency minus the median latency
    of the non-recovered completed requests of its max_tokens bucket (skipped when that bucket has
    none)."""
    baseline: dict[int, list[float]] = {}
    for record in records:
        if record.ok and not was_recovered(record):
            baseline.setdefault(_bucket(record.expected_output_tokens), []).append(record.e2e_s)
    medians = {bucket: statistics.median(values) for bucket, values in baseline.items()}
    extras = []
    for record in records:
        if record.ok and was_recovered(record):
            median = medians.get(_bucket(record.expected_output_tokens))
            if median is not None:
                extras.append((record, record.e2e_s - median))
    return extras


def extra_latencies(records: Sequence[RequestRecord]) -> list[float]:
    """The extra latencies of `recovered_extras`."""
    return [extra for _, extra in recovered_extras(records)]


def timeline_summary(timeline: Sequence[StateChange]) -> str:
    """A timeline on one line, milliseconds since its first entry: where a slow recovery spent its
    time ("CONTEXT_WAIT +0 | ... | QUEUED +2310 wait for instance ...")."""
    if not timeline:
        return "-"
    start_s = timeline[0].time_s
    parts = []
    for entry in timeline:
        where = f"@{entry.instance_id}" if entry.instance_id else ""
        detail = f" {entry.detail}" if entry.detail else ""
        parts.append(f"{entry.state}{where} +{(entry.time_s - start_s) * 1000:.0f}{detail}")
    return " | ".join(parts)


@dataclass(frozen=True)
class SlowRecovery:
    """One of the recovered requests with the most extra latency, and where its time went."""

    client_request_id: str
    extra_latency_s: float
    recoveries: tuple[tuple[str, str], ...]  # (action, cause), as in the timeline
    timeline: str  # timeline_summary

    def figures(self) -> dict[str, Any]:
        return {
            "id": self.client_request_id,
            "extra_latency_s": round(self.extra_latency_s, 3),
            "recoveries": [f"{action}:{cause}" for action, cause in self.recoveries],
            "timeline": self.timeline,
        }


SLOWEST_SHOWN = 10


def slowest_recoveries(extras: Sequence[tuple[RequestRecord, float]], count: int = SLOWEST_SHOWN) -> tuple[SlowRecovery, ...]:
    ranked = sorted(extras, key=lambda pair: pair[1], reverse=True)[:count]
    return tuple(
        SlowRecovery(soak_request_id(record.index), extra, tuple(timeline_recoveries(record.timeline)), timeline_summary(record.timeline))
        for record, extra in ranked
    )


def extra_latency_by_first_cause(extras: Sequence[tuple[RequestRecord, float]]) -> dict[str, dict[str, float | int]]:
    """Extra latency by the cause of each request's first recovery: count, p50 and p95 (seconds)."""
    groups: dict[str, list[float]] = {}
    for record, extra in extras:
        found = timeline_recoveries(record.timeline)
        groups.setdefault(found[0][1] if found else "none", []).append(extra)
    return {
        cause: {
            "count": len(values),
            "p50_s": round(percentile(values, 50, PercentileMethod.NEAREST_RANK), 3),
            "p95_s": round(percentile(values, 95, PercentileMethod.NEAREST_RANK), 3),
        }
        for cause, values in sorted(groups.items())
    }


@dataclass(frozen=True)
class Mismatch:
    client_request_id: str
    first_difference: int  # index of the first differing token (-1: the replay failed)
    detail: str


@dataclass(frozen=True)
class SoakReport:
    config: SoakConfig
    requests: int
    accepted: int
    completed: int
    failed_by_status: Mapping[str, int]  # accepted, ended with this status (lost ones excluded)
    rejected_by_status: Mapping[str, int]  # never admitted
    lost: int
    leaked_blocks: int
    token_mismatches: int
    illegal_transitions: int
    recovered: int
    extra_latency_p50_s: float | None
    extra_latency_p95_s: float | None
    extra_latency_p99_s: float | None
    recoveries_by_cause: Mapping[str, int]
    recoveries_by_action: Mapping[str, int]
    transfer_counters: Mapping[str, int]  # the faulty router's transfers_* counters
    planned_faults: Mapping[str, int]  # on first transfers, by "<kind>@<side>"
    kills: tuple[KillRecord, ...]
    unhealthy_after_settle: tuple[str, ...]
    duration_s: float
    replay_duration_s: float
    lost_ids: tuple[str, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    failures: tuple[RequestRecord, ...] = ()  # accepted, not completed (lost ones included)
    instances_after: tuple[str, ...] = ()  # the faulty cluster's instances once settled
    shm_segments_left: int = 0  # the faulty cluster's shared-memory segments once it has stopped
    slowest_recovered: tuple[SlowRecovery, ...] = ()
    extra_latency_by_cause: Mapping[str, Mapping[str, float | int]] = dataclasses.field(default_factory=dict)

    @property
    def faults_fired(self) -> int:
        """Recovery steps seen in the timelines (each is a fault or a kill the cluster absorbed)."""
        return sum(self.recoveries_by_action.values())

    @property
    def kills_recovered(self) -> int:
        return sum(1 for kill in self.kills if kill.back_after_s is not None)

    @property
    def ok(self) -> bool:
        return all(getattr(self, name) == 0 for name in MUST_BE_ZERO)

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "accepted": self.accepted,
            "completed": self.completed,
            "failed_by_status": dict(self.failed_by_status),
            "rejected_by_status": dict(self.rejected_by_status),
            "lost": self.lost,
            "leaked_blocks": self.leaked_blocks,
            "shm_segments_left": self.shm_segments_left,
            "token_mismatches": self.token_mismatches,
            "illegal_transitions": self.illegal_transitions,
            "recovered": self.recovered,
            "extra_latency_p50_s": _round(self.extra_latency_p50_s),
            "extra_latency_p95_s": _round(self.extra_latency_p95_s),
            "extra_latency_p99_s": _round(self.extra_latency_p99_s),
            "extra_latency_by_cause": {cause: dict(values) for cause, values in self.extra_latency_by_cause.items()},
            "slowest_recovered": [slow.figures() for slow in self.slowest_recovered],
            "kill_only_role": self.config.kill_role,
            "faults_fired": self.faults_fired,
            "recoveries_by_cause": dict(self.recoveries_by_cause),
            "recoveries_by_action": dict(self.recoveries_by_action),
            "transfer_counters": dict(self.transfer_counters),
            "planned_faults": dict(self.planned_faults),
            "kills": len(self.kills),
            "kills_recovered": self.kills_recovered,
            "kill_back_after_s": [None if k.back_after_s is None else round(k.back_after_s, 1) for k in self.kills],
            "unhealthy_after_settle": list(self.unhealthy_after_settle),
            "duration_s": round(self.duration_s, 1),
            "replay_duration_s": round(self.replay_duration_s, 1),
            "seed": self.config.seed,
            "fault_rate": self.config.fault_rate,
            "kill_every": self.config.kill_every,
            "data_plane": self.config.data_plane,
            "stream_interval_ms": self.config.stream_interval_ms,
            "instances": f"{self.config.prefill} PREFILL + {self.config.generation} GENERATION",
        }

    def targets(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": getattr(self, name), "target": 0, "met": getattr(self, name) == 0} for name in MUST_BE_ZERO}

    def json_line(self) -> str:
        """The benchmark JSON envelope (as `envelope` in cluster/loadgen/report.py writes it), one line."""
        return json.dumps({"bench": BENCH_NAME, "figures": self.figures(), "targets": self.targets()}, sort_keys=True)

    def table(self) -> str:
        def ms(seconds: float | None) -> str:
            return "-" if seconds is None else f"{seconds * 1000:.0f} ms"

        def counts(mapping: Mapping[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(mapping.items())) or "-"

        rows: list[tuple[str, str]] = [
            ("requests", str(self.requests)),
            ("accepted", str(self.accepted)),
            ("completed", str(self.completed)),
            ("failed with a status", f"{sum(self.failed_by_status.values())} ({counts(self.failed_by_status)})"),
            ("rejected at admission", f"{sum(self.rejected_by_status.values())} ({counts(self.rejected_by_status)})"),
            ("lost (must be 0)", str(self.lost)),
            ("leaked blocks (must be 0)", str(self.leaked_blocks)),
            ("shm segments left after stop (must be 0)", str(self.shm_segments_left)),
            ("token mismatches (must be 0)", str(self.token_mismatches)),
            ("illegal transitions (must be 0)", str(self.illegal_transitions)),
            ("recovered requests", str(self.recovered)),
            ("extra latency of recovered p50", ms(self.extra_latency_p50_s)),
            ("extra latency of recovered p95", ms(self.extra_latency_p95_s)),
            ("extra latency of recovered p99", ms(self.extra_latency_p99_s)),
            ("recoveries by cause", counts(self.recoveries_by_cause)),
            ("recoveries by action", counts(self.recoveries_by_action)),
            ("transfer counters", counts(self.transfer_counters)),
            ("faults planned on first transfers", f"{sum(self.planned_faults.values())} ({counts(self.planned_faults)})"),
            ("instance kills (back)", f"{len(self.kills)} ({self.kills_recovered})"),
            ("unhealthy after settle", ", ".join(self.unhealthy_after_settle) or "-"),
            ("soak / replay time", f"{self.duration_s:.1f} s / {self.replay_duration_s:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [
            f"chaos soak: {self.config.prefill} PREFILL + {self.config.generation} GENERATION, seed {self.config.seed}, "
            f"fault rate {self.config.fault_rate:g}, kill every {self.config.kill_every or '-'}, "
            f"data plane {self.config.data_plane}"
            + (f", tokens grouped for {self.config.stream_interval_ms:g} ms" if self.config.stream_interval_ms else ""),
            "",
        ]
        lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
        for record in self.failures[:10]:
            hops = ", ".join(f"{w.phase}@{w.instance_id}#{w.attempt}" for w in record.instances) or "-"
            last = record.timeline[-1].detail if record.timeline else record.message
            lines.append(f"failed: {soak_request_id(record.index)} {record.status} after {record.e2e_s:.1f} s; hops {hops}; {last}")
        for mismatch in self.mismatches[:10]:
            lines.append(f"mismatch: {mismatch.client_request_id} at token {mismatch.first_difference}: {mismatch.detail}")
        for slow in self.slowest_recovered[:5]:
            recoveries = ", ".join(f"{action}:{cause}" for action, cause in slow.recoveries) or "-"
            lines.append(f"slow recovery: {slow.client_request_id} +{slow.extra_latency_s:.2f} s ({recoveries}): {slow.timeline}")
        if self.lost_ids:
            lines.append(f"lost: {', '.join(self.lost_ids[:20])}")
        if self.instances_after:
            lines.append("")
            lines += [f"after settling: {line}" for line in self.instances_after]
        lines.append("")
        lines.append("PASS" if self.ok else "FAIL: " + ", ".join(f"{name}={getattr(self, name)}" for name in MUST_BE_ZERO if getattr(self, name)))
        return "\n".join(lines) + "\n"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def build_report(
    config: SoakConfig,
    records: Sequence[RequestRecord],
    replayed: Mapping[str, RequestRecord],
    *,
    leaked_blocks: int,
    illegal_transitions: int,
    transfer_counters: Mapping[str, int],
    planned: Mapping[str, tuple[str, ...]],
    kills: Sequence[KillRecord],
    unhealthy: Sequence[str],
    duration_s: float,
    replay_duration_s: float,
    instances_after: Sequence[str] = (),
) -> SoakReport:
    """The report from the records of one soak and their replays (by the soak request's client id)."""
    failed: Counter = Counter()
    rejected: Counter = Counter()
    causes: Counter = Counter()
    actions: Counter = Counter()
    mismatches: list[Mismatch] = []
    lost_ids = []
    for record in records:
        client_request_id = soak_request_id(record.index)
        if not record.accepted:
            rejected[record.status] += 1
            continue
        if record.lost:
            lost_ids.append(client_request_id)
        elif not record.ok:
            failed[record.status] += 1
        for action, cause in timeline_recoveries(record.timeline):
            actions[action] += 1
            causes[cause] += 1
        if record.ok:
            replay = replayed.get(client_request_id)
            if replay is None or not replay.ok:
                detail = "not replayed" if replay is None else f"replay failed: {replay.status} {replay.message}"
                mismatches.append(Mismatch(client_request_id, -1, detail))
            elif replay.token_ids != record.token_ids:
                first = next(
                    (i for i, (a, b) in enumerate(zip(record.token_ids, replay.token_ids, strict=False)) if a != b),
                    min(len(record.token_ids), len(replay.token_ids)),
                )
                mismatches.append(
                    Mismatch(
                        client_request_id,
                        first,
                        f"{len(record.token_ids)} tokens vs {len(replay.token_ids)} in the replay; hops "
                        + ", ".join(f"{w.phase}@{w.instance_id}#{w.attempt}" for w in record.instances),
                    )
                )
    recovered = recovered_extras(records)
    extras = [extra for _, extra in recovered]
    planned_counts: Counter = Counter(kind for kinds in planned.values() for kind in kinds)
    return SoakReport(
        config=config,
        requests=len(records),
        accepted=sum(1 for r in records if r.accepted),
        completed=sum(1 for r in records if r.ok),
        failed_by_status=dict(sorted(failed.items())),
        rejected_by_status=dict(sorted(rejected.items())),
        lost=len(lost_ids),
        leaked_blocks=leaked_blocks,
        token_mismatches=len(mismatches),
        illegal_transitions=illegal_transitions,
        recovered=sum(1 for r in records if r.ok and was_recovered(r)),
        extra_latency_p50_s=_extra_latency_percentile(extras, 50),
        extra_latency_p95_s=_extra_latency_percentile(extras, 95),
        extra_latency_p99_s=_extra_latency_percentile(extras, 99),
        recoveries_by_cause=dict(sorted(causes.items())),
        recoveries_by_action=dict(sorted(actions.items())),
        transfer_counters=dict(sorted(transfer_counters.items())),
        planned_faults=dict(sorted(planned_counts.items())),
        kills=tuple(kills),
        unhealthy_after_settle=tuple(unhealthy),
        duration_s=duration_s,
        replay_duration_s=replay_duration_s,
        lost_ids=tuple(lost_ids),
        mismatches=tuple(mismatches),
        failures=tuple(r for r in records if r.accepted and not r.ok),
        instances_after=tuple(instances_after),
        slowest_recovered=slowest_recoveries(recovered),
        extra_latency_by_cause=extra_latency_by_first_cause(recovered),
    )

