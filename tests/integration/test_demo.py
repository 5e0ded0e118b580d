"""README's main job: `duet demo` (what `make demo` runs) on this machine, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_duet_demo_serves_the_mixed_batch() -> None:
    duet = Path(sys.executable).parent / "duet"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    result = subprocess.run([str(duet), "demo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "serving on 127.0.0.1:" in out
    assert out.count("timeline: QUEUED") == 6
    assert "prefill@prefill-0, generation@generation-0" in out
    assert "outcomes: {'COMPLETE': 6}" in out
