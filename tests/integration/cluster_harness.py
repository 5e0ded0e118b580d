"""Tests run clusters the way programs do: cluster.embedded.BackgroundCluster."""

from __future__ import annotations

from cluster.embedded import BackgroundCluster


class ClusterHarness(BackgroundCluster):
    """BackgroundCluster under the name the integration tests use."""
