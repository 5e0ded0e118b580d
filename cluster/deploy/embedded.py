"""A ServingCluster on a background event loop, for programs that talk to it through the gRPC client
like a user would (the demo, the chaos soak, the load benchmark, tests).

    with BackgroundCluster(config) as cluster:
        with cluster.client() as client:
            client.complete("Hello", max_tokens=8)
        print(cluster.status().instances)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cluster.client import DuetClient
from cluster.deploy.config import ClusterConfig
from cluster.deploy.serve import ServingCluster
from cluster.router.api import ClusterView
from cluster.shutdown import STOP_TIMEOUT_S, StopTimeout

T = TypeVar("T")


class BackgroundCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="duet-cluster-loop", daemon=True)
        self.cluster: ServingCluster | None = None

    def __enter__(self) -> BackgroundCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 600.0) -> BackgroundCluster:
        """Deploy (Ray must be reachable, or it is started here) and wait until it serves."""
        self.cluster = ServingCluster(self.config)
        # Ray installs signal handlers when it starts: connect from this (usually the main) thread.
        self.cluster.deployment.connect()
        self._thread.start()
        try:
            self.run(self.cluster.start(), timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Run a coroutine on the cluster's loop and wait for its result."""
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
        """Run a plain function on the cluster's loop (to read router state safely)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper(), timeout_s)

    @property
    def target(self) -> str:
        assert self.cluster is not None
        return self.cluster.target

    @property
    def router(self):
        assert self.cluster is not None
        return self.cluster.router

    @property
    def deployment(self):
        assert self.cluster is not None
        return self.cluster.deployment

    def client(self, **kwargs: Any) -> DuetClient:
        return DuetClient(self.target, **kwargs)

    def status(self) -> ClusterView:
        return self.call(lambda: self.router.cluster_status())

    def settle(self, timeout_s: float = 20.0) -> dict[str, tuple[int, int]]:
        """Wait until nothing is in flight and every healthy instance reports all of its blocks free
        (cached-but-free blocks count as free); returns the (free, total) it saw last."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            seen = {i.instance_id: (i.free_blocks, i.total_blocks) for i in status.instances if i.health.value == "HEALTHY"}
            idle = self.call(lambda: self.router.num_in_flight) == 0
            if (idle and seen and all(free == total for free, total in seen.values())) or time.monotonic() > deadline:
                return seen
            time.sleep(0.1)

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and stop the cluster, then the loop. The shutdown bounds each of its steps
        (cluster/shutdown.py); `timeout_s` (default: the drain timeout plus five step bounds) is a
        backstop over all of them. Raises StopTimeout naming what hung."""
        if self.cluster is not None and self._thread.is_alive():
            if timeout_s is None:
                timeout_s = self.config.drain_timeout_s + 5 * STOP_TIMEOUT_S
            try:
                self.run(self.cluster.shutdown(), timeout_s=timeout_s)
            except concurrent.futures.TimeoutError:
                raise StopTimeout(f"the cluster's shutdown did not finish within {timeout_s:g} s") from None
            finally:
                self.cluster = None
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
