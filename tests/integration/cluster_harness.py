"""Run a ServingCluster (router + front end + Ray actors) on a background event loop, for tests
that talk to it through the gRPC client like a user would."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from cluster.client import DuetClient
from cluster.deploy_config import ClusterConfig
from cluster.serve import ServingCluster


class ClusterHarness:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cluster-harness", daemon=True)
        self.cluster: ServingCluster | None = None

    def start(self) -> ClusterHarness:
        self._thread.start()
        self.cluster = ServingCluster(self.config)
        self.run(self.cluster.start(), timeout_s=300)
        return self

    def run(self, coro, timeout_s: float = 60):
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout_s)

    def call(self, fn, timeout_s: float = 30):
        """Run a plain function on the cluster's loop (to read router state safely)."""

        async def wrapper():
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

    def client(self, **kwargs) -> DuetClient:
        return DuetClient(self.target, **kwargs)

    def status(self):
        return self.call(lambda: self.router.cluster_status())

    def settle(self, timeout_s: float = 20.0) -> dict[str, tuple[int, int]]:
        """Wait until every healthy instance reports all of its blocks free; returns what it saw."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            seen = {i.instance_id: (i.free_blocks, i.total_blocks) for i in status.instances if i.health.value == "HEALTHY"}
            if (seen and all(free == total for free, total in seen.values()) and self.call(lambda: self.router.num_in_flight) == 0) or time.monotonic() > deadline:
                return seen
            time.sleep(0.1)

    def stop(self) -> None:
        if self.cluster is not None:
            self.run(self.cluster.shutdown(), timeout_s=120)
            self.cluster = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
