"""Suite-wide test settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
