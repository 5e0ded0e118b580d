"""The chaos soak (`duet chaos`, bench/chaos_soak.py): many requests through a cluster whose KV
transfers fail on purpose and whose instances are killed, checked against a fault-free replay.

    report = run_soak(SoakConfig(requests=1000, seed=0, fault_rate=0.05, kill_every=100))
    print(report.table())
    print(report.json_line())          # the benchmark JSON envelope; report.ok: the four zeros hold

This module runs it; what it runs is decided in cluster/loadgen/chaos_plan.py (settings, workload,
fault plan, kill schedule, the two cluster configurations) and what it found is counted in
cluster/loadgen/chaos_report.py. Each request ends as a loadgen RequestRecord
(cluster/loadgen/metrics.py) with the soak's fields: admitted, lost, output tokens, the router's
timeline.

1. Deploys two clusters on one Ray cluster (an embedded local one, or `address` joined): the faulty
   one and a clean one for the replay.
2. Sends the seeded requests, each named "soak-<n>", at most `concurrency` in flight.
3. Kills: after every `kill_every` submitted requests, the scheduled instance actor is killed with
   `ray.kill(actor, no_restart=False)`; Ray restarts it, the router recovers its requests and
   takes it back. Before each kill the soak waits (bounded) until the previous victim is back and
   every instance is HEALTHY, so at most one instance is down at a time.
4. Settles (nothing in flight, every instance HEALTHY and all blocks free, bounded), replays every
   completed request on the clean cluster and compares tokens.

This module imports no torch (Ray and the workers are reached through cluster/deploy/embedded.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from tqdm import tqdm

from cluster.client import Completion, DuetClient, DuetError
from cluster.deploy.embedded import BackgroundCluster
from cluster.deploy.launch import DeploymentError, connect_ray
from cluster.loadgen.chaos_plan import (
    REPLAY_PREFIX,
    PlannedKill,
    SoakConfig,
    SoakError,
    SoakRequest,
    faulty_cluster_config,
    kill_schedule,
    make_requests,
    planned_faults,
    replay_cluster_config,
    soak_request_id,
)
from cluster.loadgen.chaos_report import KillRecord, SoakReport, build_report, was_recovered
from cluster.loadgen.metrics import RequestRecord
from worker.kv_transfer import shm

logger = logging.getLogger(__name__)

_POLL_S = 0.2


# ---- one request -------------------------------------------------------------------------------


def run_request(client: DuetClient, request: SoakRequest, client_request_id: str, started_s: float) -> RequestRecord:
    """Send one request and classify how it ended (never raises for a gRPC status). `started_s`:
    when the run started (time.monotonic), the origin of the record's times."""
    sent_s = time.monotonic() - started_s
    base = {"index": request.index, "sent_s": sent_s, "expected_output_tokens": request.max_tokens}
    try:
        done: Completion = client.complete(list(request.prompt_token_ids), client_request_id=client_request_id, **request.kwargs())
    except DuetError as error:
        end_s = time.monotonic() - started_s
        result = error.result
        accepted = error.request_id is not None or result is not None or _known(client, client_request_id)
        lost = accepted and (
            error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            or (result is None and error.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN))
        )
        return RequestRecord(
            end_s=end_s,
            instances=result.instances if result is not None else (),
            error=f"{error.code.name}: {error.message}",
            accepted=accepted,
            lost=lost,
            timeline=result.timeline if result is not None else (),
            **base,
        )
    return RequestRecord(
        end_s=sent_s + done.total_s,  # the client's own measurement of the call
        prompt_tokens=done.usage.prompt_tokens,
        output_tokens=len(done.token_ids),
        cached_tokens=done.usage.cached_tokens,
        finish_reason=done.finish_reason,
        instances=done.instances,
        accepted=True,
        lost=False,
        token_ids=done.token_ids,
        timeline=done.timeline,
        **base,
    )


def _known(client: DuetClient, client_request_id: str) -> bool:
    """Whether the router admitted a request whose call failed before any message came back."""
    try:
        client.get_request(client_request_id=client_request_id)
    except DuetError as error:
        if error.code == grpc.StatusCode.NOT_FOUND:
            return False
        raise SoakError(f"cannot tell whether {client_request_id} was admitted: {error}") from None
    return True


# ---- running it --------------------------------------------------------------------------------


@dataclass
class _Progress:
    """A tqdm bar on stderr (or nothing)."""

    total: int
    description: str
    enabled: bool
    _bar: Any = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._bar = tqdm(total=self.total, desc=self.description, unit="req", dynamic_ncols=True, mininterval=0.5)
        return self

    def update(self, postfix: str | None = None) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()


def _instance_states(cluster: BackgroundCluster) -> dict[str, tuple[str, str]]:
    """instance id -> (incarnation, health) as the router sees it."""
    return cluster.call(
        lambda: {iid: (instance.info.incarnation, instance.health.value) for iid, instance in cluster.router.instances.items()}
    )


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)


class _Killer:
    """Kills instance actors on schedule, one at a time, and records when each came back."""

    def __init__(self, cluster: BackgroundCluster, restart_timeout_s: float, started_s: float) -> None:
        self._cluster = cluster
        self._restart_timeout_s = restart_timeout_s
        self._started_s = started_s
        self._pending: tuple[PlannedKill, str, float] | None = None  # kill, old incarnation, killed at
        self.records: list[KillRecord] = []

    def kill(self, planned: PlannedKill) -> None:
        import ray  # when the soak runs, as cluster/deploy/launch.py does: importing this module stays cheap

        self.wait_for_last()
        _wait_until(lambda: all(h == "HEALTHY" for _, h in _instance_states(self._cluster).values()), self._restart_timeout_s)
        old = _instance_states(self._cluster)[planned.instance_id][0]
        actor = self._cluster.deployment.actors[planned.instance_id]
        logger.warning("chaos: killing instance %s (after request %d)", planned.instance_id, planned.after_request)
        ray.kill(actor, no_restart=False)
        self._pending = (planned, old, time.monotonic())

    def wait_for_last(self) -> None:
        """Wait (bounded) until the last victim is back: a new incarnation, HEALTHY."""
        if self._pending is None:
            return
        planned, old, killed_s = self._pending
        self._pending = None

        def back() -> bool:
            incarnation, health = _instance_states(self._cluster)[planned.instance_id]
            return incarnation != old and health == "HEALTHY"

        came_back = _wait_until(back, self._restart_timeout_s)
        if not came_back:
            logger.error("chaos: instance %s did not come back within %.0f s", planned.instance_id, self._restart_timeout_s)
        self.records.append(
            KillRecord(
                instance_id=planned.instance_id,
                after_request=planned.after_request,
                killed_at_s=killed_s - self._started_s,
                old_incarnation=old,
                back_after_s=time.monotonic() - killed_s if came_back else None,
            )
        )


def _drive(
    cluster: BackgroundCluster,
    requests: Sequence[SoakRequest],
    kills: Sequence[PlannedKill],
    config: SoakConfig,
    show_progress: bool,
    description: str,
    name: Callable[[SoakRequest], str],
) -> tuple[list[RequestRecord], list[KillRecord]]:
    """Send `requests` in order with at most `concurrency` in flight, killing on schedule."""
    kill_after = {kill.after_request: kill for kill in kills}
    started_s = time.monotonic()
    killer = _Killer(cluster, config.restart_timeout_s, started_s)
    slots = threading.BoundedSemaphore(config.concurrency)
    outcome_counts: Counter = Counter()
    with (
        _Progress(len(requests), description, show_progress) as bar,
        cluster.client(timeout_s=config.lost_after_s) as client,
        concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix="soak") as pool,
    ):

        def finished(future: concurrent.futures.Future) -> None:
            slots.release()
            record = None if future.exception() is not None else future.result()
            if record is not None:
                outcome_counts["recovered" if record.ok and was_recovered(record) else record.status] += 1
            bar.update(", ".join(f"{k}={v}" for k, v in sorted(outcome_counts.items())))

        futures = []
        for request in requests:
            slots.acquire()
            future = pool.submit(run_request, client, request, name(request), started_s)
            future.add_done_callback(finished)
            futures.append(future)
            planned = kill_after.get(request.index)
            if planned is not None:
                killer.kill(planned)
                bar.write(f"killed {planned.instance_id} after request {planned.after_request}")
        records = [future.result() for future in futures]
    killer.wait_for_last()
    return records, killer.records


def _settle(cluster: BackgroundCluster, timeout_s: float) -> tuple[int, tuple[str, ...]]:
    """Wait (bounded) for every instance to be HEALTHY and all blocks free; (leaked, unhealthy)."""
    deadline = time.monotonic() + timeout_s
    _wait_until(lambda: all(h == "HEALTHY" for _, h in _instance_states(cluster).values()), timeout_s)
    seen = cluster.settle(timeout_s=max(1.0, deadline - time.monotonic()))
    unhealthy = tuple(sorted(iid for iid, (_, health) in _instance_states(cluster).items() if health != "HEALTHY"))
    return sum(total - free for free, total in seen.values()), unhealthy


def _instance_lines(cluster: BackgroundCluster) -> tuple[str, ...]:
    """One line per instance as the router sees it (for the report: where things stood)."""
    view = cluster.status()
    states = dict(view.requests_by_state)
    lines = [
        f"{i.instance_id} {i.health.value} free {i.free_blocks}/{i.total_blocks} queued {i.queued_requests} "
        f"running {i.running_requests} transfers {i.active_transfers}"
        for i in view.instances
    ]
    if states:
        lines.append("requests in flight by state: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items())))
    return tuple(lines)


def _router_counters(cluster: BackgroundCluster) -> tuple[int, dict[str, int]]:
    extra = cluster.status().extra
    illegal = int(extra.get("illegal_transitions", 0) + extra.get("inconsistent_reports", 0))
    transfers = {key.removeprefix("transfers_"): int(value) for key, value in extra.items() if key.startswith("transfers_")}
    return illegal, transfers


def run_soak(config: SoakConfig, *, show_progress: bool = True) -> SoakReport:
    """Deploy, soak, settle, replay, report (see the module docstring). Raises SoakError when a
    cluster cannot be deployed; everything the clusters do wrong ends up in the report."""
    faulty_config = faulty_cluster_config(config)
    replay_config = replay_cluster_config(config)
    # Connected here so that both deployments share the Ray cluster and neither shuts it down.
    started_ray = connect_ray(faulty_config)
    faulty = BackgroundCluster(faulty_config)
    clean = BackgroundCluster(replay_config)
    try:
        try:
            with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="soak-deploy") as pool:
                starting = [pool.submit(cluster.start) for cluster in (faulty, clean)]
                for future in starting:
                    future.result()
        except DeploymentError as error:
            raise SoakError(f"cannot deploy: {error}") from None
        vocab_size = faulty.router.vocab_size
        shm_tag = faulty.deployment.deployment_id  # the cluster is gone once stopped
        requests = make_requests(config, vocab_size)
        plan = faulty_config.faults or {}
        planned = planned_faults(plan, requests)
        instance_ids = sorted(faulty.deployment.actors)
        roles = {i: m.info.role.name.lower() for i, m in faulty.router.fleet.members.items()}
        schedule = kill_schedule(config, instance_ids, roles)
        logger.info("soak: %d requests, %d planned faults on first transfers, %d kills", len(requests), len(planned), len(schedule))

        started_s = time.monotonic()
        records, kills = _drive(faulty, requests, schedule, config, show_progress, "soak", lambda r: r.client_request_id)
        leaked, unhealthy = _settle(faulty, config.settle_timeout_s)
        instances_after = _instance_lines(faulty)
        duration_s = time.monotonic() - started_s

        by_index = {request.index: request for request in requests}
        completed = [by_index[r.index] for r in records if r.ok]
        replay_started_s = time.monotonic()
        replay_records, _ = _drive(
            clean, completed, (), config, show_progress, "replay", lambda r: f"{REPLAY_PREFIX}-{r.index}"
        )
        replay_duration_s = time.monotonic() - replay_started_s
        replayed = {soak_request_id(record.index): record for record in replay_records}

        illegal_faulty, transfers = _router_counters(faulty)
        illegal_clean, _ = _router_counters(clean)
        report = build_report(
            config,
            records,
            replayed,
            leaked_blocks=leaked,
            illegal_transitions=illegal_faulty + illegal_clean,
            transfer_counters=transfers,
            planned=planned,
            kills=kills,
            unhealthy=unhealthy,
            duration_s=duration_s,
            replay_duration_s=replay_duration_s,
            instances_after=instances_after,
        )
    finally:
        for cluster in (faulty, clean):
            try:
                cluster.stop()
            except Exception as error:  # noqa: BLE001 - stop both, report the first problem in the log
                logger.error("stopping a soak cluster: %s", error)
        if started_ray:
            import ray  # see _Killer.kill

            ray.shutdown()
    # Killed instances never closed their senders: the stop's sweep must have removed their segments.
    return replace(report, shm_segments_left=len(shm.segments(shm_tag)))
