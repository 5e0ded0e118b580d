"""Suite-wide test settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Ray, set before anything imports it (its constants are read at import time):
# - joining an existing cluster, Ray swaps a loopback address for this machine's outward IP, which a
#   sandbox may not route; this switch (inert on Linux otherwise) keeps every test on 127.0.0.1;
# - no usage reporting from tests.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Deterministic property tests: the same examples on every run and machine, no timing deadline
# (CI machines are slow and shared).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
