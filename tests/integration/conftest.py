"""Integration fixtures: one real local Ray cluster per test module, pinned to 127.0.0.1."""

from __future__ import annotations

import pytest
from cluster_harness import local_ray_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster() as ray:
        yield ray
