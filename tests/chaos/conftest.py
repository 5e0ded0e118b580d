"""Chaos fixtures: one real local Ray cluster per test module, pinned to 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The integration helpers (cluster_harness) are shared with the chaos suite.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from cluster_harness import local_ray_cluster  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster() as ray:
        yield ray
