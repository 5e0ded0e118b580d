"""Tests run clusters the way programs do (cluster.embedded.BackgroundCluster), on a local Ray cluster."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from cluster.deploy.embedded import BackgroundCluster

T = TypeVar("T")


class ClusterHarness(BackgroundCluster):
    """BackgroundCluster under the name the integration tests use."""

    def assert_no_router_bug(self) -> None:
        """Invariant 6 (only legal transitions) and consistent instance reports so far; a refused
        transition fails with the stack that attempted it (the router keeps the last few)."""
        router = self.router
        illegal, inconsistent, reports = self.call(
            lambda: (router.illegal_transitions, router.inconsistent_reports, list(router.illegal_transition_reports))
        )
        assert illegal == 0, f"{illegal} illegal transition(s):\n" + "\n".join(reports)
        assert inconsistent == 0, f"{inconsistent} inconsistent instance report(s)"


# Ray waits a fixed 30 s for a new node's raylet (and its GCS) to come up. On CI's 2 cores, with the
# other test worker booting a cluster of its own (tests/integration/test_sim_bench_smoke.py deploys
# real ones), that wait ran out twice in three runs on 2026-12-07: a start-up that lost the race
# for the cores, not a failure of anything under test. It is tried once more.
RAY_START_ATTEMPTS = 2


def start_ray(start: Callable[[], T], clean_up: Callable[[], None], what: str) -> T:
    """`start()` (a Ray node or cluster coming up), tried once more when Ray's fixed start-up wait
    ran out; `clean_up()` after each failed try, so that nothing a try started is left running."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            return start()
        except Exception as error:  # noqa: BLE001 - Ray raises bare Exception / RuntimeError for these
            clean_up()
            timed_out = "timed out during startup" in str(error) or "Timed out waiting for file" in str(error)
            if not timed_out or attempt == RAY_START_ATTEMPTS:
                raise
            warnings.warn(f"{what} timed out starting, trying again: {error}", stacklevel=2)
    raise AssertionError("unreachable")


@contextmanager
def local_ray_cluster(num_cpus: int = 4) -> Iterator[Any]:
    """A local Ray cluster pinned to 127.0.0.1, no dashboard, stopped on exit (one per test module:
    ray.init takes seconds)."""
    import ray

    start_ray(
        lambda: ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        ),
        ray.shutdown,
        "ray.init of a local node",
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def await_state(client: Any, request_id: str, state: str, timeout_s: float = 60.0) -> None:
    """Poll GetRequest until the request is in `state`; fail on timeout or when it ended first."""
    import grpc

    from cluster.client import DuetError

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = client.get_request(request_id).state
        except DuetError as error:
            if error.code != grpc.StatusCode.NOT_FOUND:
                raise
        if last == state:
            return
        if last in ("COMPLETE", "ERROR", "ABORTED"):
            break
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never reached {state} (last {last})")
