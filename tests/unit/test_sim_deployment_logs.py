"""What a deployment's logs measure (cluster/sim/deployment_logs.py): the hand-over's control path
from the step logs and the router's timelines, the censored median of hand-overs that met a busy
instance, and how logged steps ran against a profile. Synthetic logs, no timing assertions."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path

import pytest

from cluster.sim import deployment_logs as logs
from cluster.sim.link import DATA_PLANES
from cluster.sim.profile import StepProfile, context_pairs

PROFILE = StepProfile(
    name="test", source="measured", device="test", model="test", step_overhead_s=1e-3, prefill_s_per_token=2e-5,
    prefill_s_per_token_pair=1e-8, decode_s_per_sequence=2e-4, decode_s_per_context_token=1e-7,
    handover_fixed_s=1e-3, kv_bytes_per_token=4096,
)


def test_the_hand_over_is_measured_from_the_context_s_step_to_the_step_taking_it_up_on_an_idle_instance(tmp_path: Path) -> None:
    """Since a landed hand-over's commit is reported with its first decode step's token, the router's
    TRANSMISSION to GENERATING holds that step and the poll's way back: the measurement takes the
    steps themselves, and leaves out requests that may have waited for a busy generation step."""
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    prefill = [(100.000, 100.050), (101.000, 101.050)]  # (start, end): each finishes one request's context
    # Request 1: the generation instance idle until 100.070, then a 10 ms step taking it up (20 ms
    # after its context's end). Request 2: a step runs in between (101.055-101.075): it may have waited.
    generation = [(100.070, 100.080), (101.055, 101.075), (101.076, 101.086)]
    for name, spans in (("prefill-0", prefill), ("generation-0", generation)):
        rows = [{"t": end, "ctx": 0, "pairs": 0, "seqs": 1, "dctx": 1, "s": end - start, "loop_s": end - start} for start, end in spans]
        (steps_dir / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    timeline_path = tmp_path / "timelines.jsonl"

    def record(queued: float, transmission: float, generating: float) -> dict:
        return {"usage": {"prompt_tokens": 64}, "timeline": [
            {"state": "QUEUED", "time_s": queued, "instance_id": None},
            {"state": "CONTEXT_IN_PROGRESS", "time_s": queued + 0.01, "instance_id": "prefill-0"},
            {"state": "TRANSMISSION", "time_s": transmission, "instance_id": "prefill-0"},
            {"state": "GENERATING", "time_s": generating, "instance_id": "generation-0"},
        ]}

    # The router hears each a few ms after the step that caused it.
    timeline_path.write_text("".join(json.dumps(r) + "\n" for r in (record(99.99, 100.053, 100.084), record(100.99, 101.053, 101.089))))
    spans = logs.step_spans(steps_dir)
    assert spans["generation-0"] == sorted(generation)
    link_s = DATA_PLANES[logs.HANDOVER_PLANE].transfer_s(64 * 4096)
    timelines = logs.request_timelines(timeline_path)
    idle, busy = logs.handover_seconds(timelines, spans, 16, 4096, since_s=0.0)
    assert idle == [pytest.approx(0.020 - link_s)]  # not 0.031: the router's span held the step
    # Request 2 landed after the step in between started (else that step would have taken it up) and
    # by the start of the one that did.
    assert busy == [(pytest.approx(0.005 - link_s), pytest.approx(0.026 - link_s))]
    assert logs.handover_seconds(timelines, spans, 16, 4096, since_s=100.5) == ([], busy)  # the first admitted before


def test_the_censored_median_finds_the_hand_over_of_requests_that_met_a_busy_generation_instance() -> None:
    """A generation instance stepping back to back takes a hand-over up at the first step to start
    after it lands: each such request gives only the interval between two step starts. The estimate
    from such intervals alone finds the true median, where the intervals' ends and middles do not."""
    rng = random.Random(7)
    intervals, truths = [], []
    for _ in range(400):
        starts = [0.0]
        while starts[-1] < 0.3:
            starts.append(starts[-1] + rng.uniform(0.015, 0.035))  # decode steps, back to back
        context_end = rng.uniform(0.05, 0.2)
        handover = rng.uniform(0.008, 0.020)  # median 14 ms
        truths.append(handover)
        taken_up = next(i for i, start in enumerate(starts) if start >= context_end + handover)
        intervals.append((max(context_end, starts[taken_up - 1]) - context_end, starts[taken_up] - context_end))
    estimate = logs.censored_median([], intervals)
    assert estimate == pytest.approx(statistics.median(truths), abs=0.0015)
    assert statistics.median(high for _, high in intervals) > 0.020  # what an upper bound would say
    # Exact observations alone: their median; none at all: nothing.
    assert logs.censored_median([0.003, 0.001, 0.002], []) == 0.002
    assert logs.censored_median([], []) is None
    # Mixed: the exact values pin the mass the intervals leave open.
    assert logs.censored_median([0.010] * 5, [(0.0, 0.030)] * 3) == pytest.approx(0.010)


def test_step_speed_is_the_logged_steps_time_over_the_profile_s_model(tmp_path: Path) -> None:
    profile = dataclasses.replace(PROFILE, contention=0.5)
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    assert logs.step_speed(steps_dir, profile) is None  # nothing logged
    # One instance alone (no contention): steps 1.5 times the model's.
    rows, now = [], 10.0
    for seqs in (1, 2, 4, 8):
        step_s = 1.5 * profile.step_s(128, context_pairs(0, 128), seqs, seqs * 64)
        now += step_s + 1e-3
        rows.append({"t": now, "ctx": 128, "pairs": context_pairs(0, 128), "seqs": seqs, "dctx": seqs * 64, "s": step_s, "loop_s": step_s})
    (steps_dir / "mixed-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert logs.step_speed(steps_dir, profile) == pytest.approx(1.5)
    # Another instance mid-step through all of them (one long step from t=1): the model's contention
    # (1 + 0.5 x 1) explains a further 1.5x, so they still ran at 1.5; that long step itself, alone
    # as it started, ran `lone` times its model.
    slower = [row | {"s": row["s"] * 1.5, "loop_s": row["loop_s"] * 1.5} for row in rows]
    (steps_dir / "mixed-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in slower))
    (steps_dir / "mixed-1.jsonl").write_text(json.dumps({"t": now + 1.0, "ctx": 0, "pairs": 0, "seqs": 1, "dctx": 1, "s": now, "loop_s": now}) + "\n")
    lone = now / profile.step_s(0, 0, 1, 1)
    assert logs.step_speed(steps_dir, profile) == pytest.approx((4 * 1.5 + lone) / 5)
    # By kind: the four context steps started contended, the decode-only one alone.
    kinds = logs.step_speeds_by_kind(steps_dir, profile)
    assert kinds["all"] == (5, pytest.approx((4 * 1.5 + lone) / 5))
    assert kinds["context"] == kinds["contended"] == (4, pytest.approx(1.5))
    assert kinds["decode_only"] == kinds["alone"] == (1, pytest.approx(lone))
