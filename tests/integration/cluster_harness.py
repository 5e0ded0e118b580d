"""Tests run clusters the way programs do (cluster.embedded.BackgroundCluster), on a local Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cluster.embedded import BackgroundCluster


class ClusterHarness(BackgroundCluster):
    """BackgroundCluster under the name the integration tests use."""


@contextmanager
def local_ray_cluster(num_cpus: int = 4) -> Iterator[Any]:
    """A local Ray cluster pinned to 127.0.0.1, no dashboard, stopped on exit (one per test module:
    ray.init takes seconds)."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
