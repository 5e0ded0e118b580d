"""TensorRT-LLM's peer scenarios, replayed on our scheduler (every case must pass)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import replay

REPO = Path(__file__).resolve().parents[2]
CASES = replay.load_cases(replay.DEFAULT_CASES)


def test_the_repo_holds_every_reference_case() -> None:
    data = json.loads(replay.DEFAULT_CASES.read_text())
    assert data["schema_version"] == 2
    assert len(CASES) == 68
    derived = [c for c in CASES if "derived_from_reference_model" in c]
    assert len(derived) == 30


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_peer_case(case: dict) -> None:
    assert replay.run_case(case) is None


def _mutated(case_name: str, mutate) -> dict:
    case = copy.deepcopy(next(c for c in CASES if c["name"] == case_name))
    mutate(case)
    return case


@pytest.mark.parametrize(
    ("name", "mutate", "fragment"),
    [
        ("SimpleShouldFit[MAX_UTILIZATION]", lambda c: c["expected"].update(num_iterations=81), "iterations"),
        (
            "SimpleDoesntFitMaxUtilization",
            lambda c: c["derived_from_reference_model"].update(pause_events=[]),
            "pause events",
        ),
        (
            "DelayDuplicateRequest[GUARANTEED_NO_EVICT]",
            lambda c: c["expected"].update(num_reused_blocks=3),
            "num_reused_blocks",
        ),
        ("BeamWidthMismatchSkipped", lambda c: c["expected"].update(generation_ids=[2, 0]), "generation ids"),
        (
            "ForceChunkTest.CapacityLimits",
            lambda c: c["expected"]["FORCE_CHUNK"].update(chunk_sizes_single_call=[10, 5]),
            "chunk sizes",
        ),
    ],
)
def test_a_wrong_expectation_fails(name: str, mutate, fragment: str) -> None:
    failure = replay.run_case(_mutated(name, mutate))
    assert failure is not None and fragment in failure


def test_unknown_harness_is_rejected() -> None:
    with pytest.raises(replay.UnknownHarness):
        replay.run_case({"name": "x", "harness": "nope"})


def test_cli_with_system_python(tmp_path: Path) -> None:
    python = shutil.which("python3") or sys.executable
    ok = subprocess.run([python, "-m", "scheduler.replay"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr
    lines = ok.stdout.strip().splitlines()
    assert lines[-1] == "68 passed, 0 failed"
    assert sum(line.startswith("PASS ") for line in lines) == 68

    bad = _mutated("SimpleShouldFit[MAX_UTILIZATION]", lambda c: c["expected"].update(num_iterations=81))
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"schema_version": 2, "cases": [bad]}))
    failed = subprocess.run([python, "-m", "scheduler.replay", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1
    assert failed.stdout.splitlines()[0].startswith("FAIL SimpleShouldFit[MAX_UTILIZATION]: ")
    assert failed.stdout.strip().splitlines()[-1] == "0 passed, 1 failed"

    path.write_text(json.dumps({"cases": [{"name": "x", "harness": "unknown"}]}))
    unknown = subprocess.run([python, "-m", "scheduler.replay", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    path.write_text("{not json")
    unreadable = subprocess.run([python, "-m", "scheduler.replay", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert unreadable.returncode == 2
