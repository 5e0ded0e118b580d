"""Chaos fixtures: one real local Ray cluster per test module, pinned to 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The integration helpers (cluster_harness) are shared with the chaos suite.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
