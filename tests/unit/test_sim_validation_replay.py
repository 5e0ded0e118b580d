"""bench/sim_validation.py's stored real side (--out / --replay): a file that does not describe two
real runs of every metric for every case of known clusters is refused with one line, never
simulated against; and the noise floor it reports is the expected error of an exact prediction."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
from pathlib import Path

import pytest

from cluster.sim.catalog import load_profile

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("sim_validation_bench", REPO / "bench" / "sim_validation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validation = _bench()
PROFILE = load_profile("cpu-builtin-deployed").to_dict()
RUN = {"ttft_p50": 100.0, "ttft_p90": 200.0, "tpot_p50": 10.0, "tpot_p90": 12.0}


def _stored(**changes) -> dict:
    document = {
        "seed": 0, "requests_per_case": 6, "profiles": {"1p1g": PROFILE},
        "rates": {"1p1g": {"prefill_heavy": 5.0}}, "real": {"1p1g": {"prefill_heavy": [RUN, RUN]}},
    }
    document.update(changes)
    return document


def test_a_well_formed_file_loads(tmp_path) -> None:
    path = tmp_path / "real_runs.json"
    path.write_text(json.dumps(_stored()))
    stored = validation.load_real_runs(path)
    assert stored.real["1p1g"]["prefill_heavy"][1] == RUN and stored.rates["1p1g"]["prefill_heavy"] == 5.0


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"real": {"1p1g": {"prefill_heavy": [RUN]}}}, "is not two runs"),
        ({"real": {"1p1g": {"prefill_heavy": [RUN, {"ttft_p50": 1.0}]}}}, "is not two runs"),
        ({"real": {"1p1g": {"no_such_case": [RUN, RUN]}}, "rates": {"1p1g": {"no_such_case": 1.0}}}, "is not two runs"),
        ({"real": {"4p4g": {"prefill_heavy": [RUN, RUN]}}}, "lacks its profile or rates"),
        ({"rates": {"1p1g": {}}}, "lacks its profile or rates"),
        ({"real": {}}, "no clusters"),
        ({"profiles": {"1p1g": {"format": "duet.step_profile.v1"}}}, "the profile of 1p1g"),
        ({"seed": "zero"}, "Expected `int`"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_a_malformed_file_is_refused_with_one_line(tmp_path, changes, says) -> None:
    path = tmp_path / "real_runs.json"
    path.write_text(json.dumps(_stored(**changes)))
    with pytest.raises(SystemExit) as refused:
        validation.load_real_runs(path)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_missing_file_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--replay"):
        validation.load_real_runs(tmp_path / "absent.json")


def test_the_noise_floor_is_what_an_exact_prediction_misses_by() -> None:
    # Two runs of a metric with expectation 100 and spread 20: the exact prediction (100) misses
    # their mean by, on average, what the floor says from the two runs alone.
    rng = random.Random(7)
    missed, floors = [], []
    for _ in range(20000):
        a, b = rng.gauss(100, 20), rng.gauss(100, 20)
        missed.append(abs(100 - (a + b) / 2) / ((a + b) / 2))
        floors.append(validation.noise_floor(a, b))
    assert statistics.fmean(floors) == pytest.approx(statistics.fmean(missed), rel=0.03)
    assert validation.noise_floor(None, 1.0) is None and validation.noise_floor(0.0, 0.0) is None
    assert validation.noise_floor(100.0, 100.0) == 0.0


def test_a_replay_that_would_keep_step_logs_is_refused(tmp_path, capsys) -> None:
    # A replay runs nothing real, so it has no step logs to keep: refused before anything runs.
    path = tmp_path / "real_runs.json"
    path.write_text(json.dumps(_stored()))
    with pytest.raises(SystemExit) as refused:
        validation.main(["--replay", str(path), "--keep-steps", str(tmp_path / "steps")])
    assert refused.value.code == 2
    assert "runs nothing real (no --keep-steps)" in capsys.readouterr().err
    assert not (tmp_path / "steps").exists()
