"""Run one bench script in a subprocess and return its last stdout line, the result envelope of
docs/architecture.md, "Benchmarks"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float = 170) -> tuple[dict[str, Any], str]:
    """`python bench/<script> <args>` from the repo root; asserts it exits 0. Returns the summary
    and what the script wrote to stderr (its progress)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr
