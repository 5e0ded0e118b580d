"""What a deployment's logs measure: its instances' step logs (worker/profiler.py StepLog) and the
router's timeline log (`frontend.timeline_log`), read back and set against each other and against a
step-time profile.

`duet profile --deployed` (cluster/sim/deployed.py) fits its profile and its control-path times from
these; bench/sim_validation.py checks how a run's kept steps ran against a profile (`step_speed`,
`step_speeds_by_kind`). Step spans are wall-clock [t - loop_s, t]; one instance's steps do not
overlap each other.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.sim.link import DATA_PLANES
from cluster.sim.profile import StepProfile

HANDOVER_PLANE = "grpc-loopback"  # the link model whose time the hand-over's control path excludes


def _timeline_records(timeline_path: Path) -> Iterator[dict[str, Any]]:
    """The records of the router's timeline log (`frontend.timeline_log`: one JSON object a line);
    a line that does not parse (one being written as the run ended) is skipped."""
    if not timeline_path.exists():
        return
    for line in timeline_path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


def handover_seconds(
    timelines: list[dict[str, Any]], spans: dict[str, list[tuple[float, float]]], tokens_per_block: int, kv_bytes_per_token: int,
    since_s: float,
) -> tuple[list[float], list[tuple[float, float]]]:
    """Per disaggregated request admitted at or after wall-clock `since_s`: its hand-over's control
    path, from the end of the prefill instance's step that finished its context until the request
    could join a generation step, less the link model's time for its KV bytes. The push, the commit
    and the generation instance's wake-up, which is what the simulator's hand-over takes before the
    request joins a step (cluster/sim/handover.py).

    Returns (idle, busy). `idle`: the exact time for each request whose generation instance was idle
    from its context's end until the step that took it up (to that step's start). `busy`: for the
    others, the interval the time lies in: the engine takes up what landed at the start of its next
    step (worker/engine.py), so a request taken up by generation step j landed after step j-1 started
    (or at the context's end, if that was later) and by step j's start (censored_median estimates
    their median).

    Not the router's TRANSMISSION to GENERATING: an instance reports a landed hand-over's commit with
    the token of its first decode step (worker/instance.py, since ca4d585), so that span holds the
    whole step and the poll's way back, which the simulator runs and charges itself; and a request
    that waited for a busy generation instance's step to end waited for what the simulator also
    models. `timelines`: request_timelines; `spans`: each instance's logged steps (step_spans)."""
    link = DATA_PLANES[HANDOVER_PLANE]
    idle: list[float] = []
    busy: list[tuple[float, float]] = []
    for times in timelines:
        transmission, generating = times.get("TRANSMISSION"), times.get("GENERATING")
        if transmission is None or generating is None or times.get("QUEUED", 0.0) < since_s:
            continue
        prefill, generation = spans.get(times.get("context_instance", "")), spans.get(times.get("generation_instance", ""))
        if not prefill or not generation:
            continue
        # The prefill step whose end the router heard as TRANSMISSION, and the generation step whose
        # outputs it heard as GENERATING: the last ones to end before each.
        context_end = _last_ending_before(prefill, transmission)
        taken_up = _last_ending_before(generation, generating)
        if context_end is None or taken_up is None or generation[taken_up][0] < prefill[context_end][1]:
            continue
        context_end_s, taken_up_s = prefill[context_end][1], generation[taken_up][0]
        link_s = link.transfer_s(math.ceil(times["prompt_tokens"] / tokens_per_block) * tokens_per_block * kv_bytes_per_token)
        if taken_up and generation[taken_up - 1][1] > context_end_s:
            # The generation instance stepped in between: the request may have waited for its step.
            landed_after_s = max(context_end_s, generation[taken_up - 1][0])
            busy.append((max(0.0, landed_after_s - context_end_s - link_s), max(0.0, taken_up_s - context_end_s - link_s)))
        else:
            idle.append(max(0.0, taken_up_s - context_end_s - link_s))
    return idle, busy


def censored_median(exact: list[float], intervals: list[tuple[float, float]], tolerance: float = 1e-9) -> float | None:
    """The median of a distribution observed exactly (`exact`) and only as the closed interval each
    value lies in (`intervals`), by Turnbull's nonparametric maximum-likelihood estimate: the
    probability mass sits on the innermost intervals (each an interval's left end followed, among
    all the ends in order, by a right end), and the self-consistency iteration (an EM) spreads it
    over them. The median is the middle of the innermost interval where the cumulative mass
    reaches one half (the estimate says nothing of where within it). None without observations."""
    observations = [(value, value) for value in exact] + [(min(low, high), max(low, high)) for low, high in intervals]
    if not observations:
        return None
    ends = sorted([(low, 0) for low, _ in observations] + [(high, 1) for _, high in observations])  # a left end first on a tie
    innermost = [(ends[i][0], ends[i + 1][0]) for i in range(len(ends) - 1) if ends[i][1] == 0 and ends[i + 1][1] == 1]
    lows = np.array([low for low, _ in observations])[:, None]
    highs = np.array([high for _, high in observations])[:, None]
    holds = (lows <= np.array([p for p, _ in innermost])[None, :]) & (np.array([q for _, q in innermost])[None, :] <= highs)
    mass = np.full(len(innermost), 1.0 / len(innermost))
    for _ in range(10_000):
        likelihood = holds @ mass  # each observation's probability under the current masses (> 0: each holds one)
        updated = mass * (holds / likelihood[:, None]).mean(axis=0)
        settled = float(np.abs(updated - mass).max()) < tolerance
        mass = updated
        if settled:
            break
    reached = int(np.searchsorted(np.cumsum(mass), 0.5 - tolerance))
    low, high = innermost[min(reached, len(innermost) - 1)]
    return (low + high) / 2


def _last_ending_before(spans: list[tuple[float, float]], time_s: float) -> int | None:
    """The index of the last of one instance's steps (by start; they do not overlap, so also by end)
    to end at or before `time_s`."""
    index = bisect.bisect_right(spans, time_s, key=lambda span: span[1]) - 1
    return index if index >= 0 else None


def step_spans(steps_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """Per instance (its step log's name), its logged steps' (start, end) wall-clock spans by start."""
    steps: dict[str, list[tuple[float, float]]] = {}
    for path in steps_dir.glob("*.jsonl"):
        spans = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                spans.append((record["t"] - record["loop_s"], record["t"]))
            except (ValueError, KeyError, TypeError):
                continue
        steps[path.stem] = sorted(spans)
    return steps


def request_timelines(timeline_path: Path) -> list[dict[str, Any]]:
    """Per ended request: its first time in each global state (wall clock), its prompt length
    ("prompt_tokens"), the instance that ran its context ("context_instance") and the one that
    took up its generation ("generation_instance")."""
    out = []
    for record in _timeline_records(timeline_path):
        times: dict[str, Any] = {}
        for entry in record.get("timeline", ()):
            times.setdefault(entry["state"], entry["time_s"])
            if entry["state"] == "CONTEXT_IN_PROGRESS":
                times.setdefault("context_instance", entry.get("instance_id") or "")
            elif entry["state"] == "GENERATING":
                times.setdefault("generation_instance", entry.get("instance_id") or "")
        times["prompt_tokens"] = record.get("usage", {}).get("prompt_tokens", 0)
        times["end"] = record["timeline"][-1]["time_s"] if record.get("timeline") else 0.0
        out.append(times)
    return out


def frontend_ways(runs: Iterable[Any], timelines: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """From each point's records (`runs`: deployed.py's _PointRun, its started_s, ended_s, records)
    matched in order with the timelines of the requests the router admitted meanwhile: the front
    end's way in (sent to QUEUED) and its way out (the router's first token to the client's:
    GENERATION_INIT, or GENERATING when colocated)."""
    ways_in, ways_out = [], []
    for run in runs:
        admitted = sorted((t for t in timelines if run.started_s <= t.get("QUEUED", 0.0) <= run.ended_s), key=lambda t: t["QUEUED"])
        records = sorted((r for r in run.records if r.ok and r.chunk_times_s), key=lambda r: r.sent_s)
        if len(admitted) != len(records):
            continue  # a request failed or was retried: no safe matching
        for record, times in zip(records, admitted, strict=True):
            ways_in.append(times["QUEUED"] - (run.started_s + record.sent_s))
            first = times.get("GENERATION_INIT", times.get("GENERATING"))
            if first is not None:
                ways_out.append(run.started_s + record.chunk_times_s[0] - first)
    return ways_in, ways_out


def call_ways(timelines: list[dict[str, Any]], steps: dict[str, list[tuple[float, float]]], since_s: float) -> tuple[list[float], list[float]]:
    """The router's calls as its instances saw them, for requests admitted at or after `since_s`
    while the instance that ran their context was idle: the submit's way there (QUEUED to the start
    of that instance's next step) and a poll's answer's way back (that step's start, where it
    publishes "prefill started", to CONTEXT_IN_PROGRESS). `steps`: step_spans."""
    ways_there, ways_back = [], []
    for times in timelines:
        queued, started, instance = times.get("QUEUED"), times.get("CONTEXT_IN_PROGRESS"), times.get("context_instance")
        if queued is None or started is None or queued < since_s or instance not in steps:
            continue
        spans = steps[instance]
        index = bisect.bisect_left(spans, (queued, queued))
        if index and spans[index - 1][1] > queued:
            continue  # a step was running when the request came: it waited for the instance
        if index == len(spans) or spans[index][0] > started:
            continue
        ways_there.append(spans[index][0] - queued)
        ways_back.append(started - spans[index][0])
    return ways_there, ways_back


@dataclass(frozen=True)
class LoggedStep:
    """A logged step and how many of the other instances were mid-step when it started."""

    sample: Any  # worker.profiler.StepSample
    busy: float


def logged_steps(steps_dir: Path, since_s: float = 0.0) -> list[LoggedStep]:
    """Every instance's logged steps that ended at or after wall-clock `since_s`, each with the
    number of the other instances (their step logs in `steps_dir`) whose logged step covers its
    start (spans as the module docstring says)."""
    from worker.profiler import read_step_log

    # Per instance: (start, end, step) of its steps, by start.
    spans = {
        path.stem: sorted(((ended_s - sample.step_s, ended_s, sample) for ended_s, sample in read_step_log(path)), key=lambda row: row[0])
        for path in sorted(steps_dir.glob("*.jsonl"))
    }
    starts = {name: [row[0] for row in rows] for name, rows in spans.items()}
    steps = []
    for name, rows in spans.items():
        others = [other for other in spans if other != name]
        for start, end, sample in rows:
            if end < since_s:
                continue
            busy = 0
            for other in others:
                index = bisect.bisect_right(starts[other], start) - 1
                busy += index >= 0 and spans[other][index][1] > start
            steps.append(LoggedStep(sample, float(busy)))
    return steps


def modelled_s(profile: StepProfile, sample: Any) -> float:
    """The profile's model time of a logged step (a worker.profiler.StepSample), contention aside."""
    return profile.step_s(
        sample.context_tokens, sample.context_pairs, sample.decode_sequences, sample.decode_context_tokens, sample.context_cached_tokens,
    )


def step_speed(steps_dir: Path, profile: StepProfile) -> float | None:
    """How a deployment's logged steps (`steps_dir`: its instances' step logs) ran against `profile`:
    the mean over the steps of their time over the profile's model of them, contention included
    (the fit meets the mean step, so 1.0 when the model meets these steps on average; above 1 when
    they ran slower, because the host did or because the model misses their shapes). None when
    nothing was logged."""
    steps = logged_steps(steps_dir)
    if not steps:
        return None
    return statistics.fmean(speed_of(step, profile) for step in steps)


def step_speeds_by_kind(steps_dir: Path, profile: StepProfile) -> dict[str, tuple[int, float | None]]:
    """`step_speed` of all the logged steps and of each kind: those that run context and the
    decode-only ones, those that started alone and those that started while another instance was
    mid-step. Each: (steps, their mean measured over modelled time; None when there are none).
    Where a profile misses, whether it misses one kind (its shapes, or its contention) or all alike
    (the host's level)."""
    kinds: dict[str, list[float]] = {"all": [], "context": [], "decode_only": [], "alone": [], "contended": []}
    for step in logged_steps(steps_dir):
        speed = speed_of(step, profile)
        kinds["all"].append(speed)
        kinds["context" if step.sample.context_tokens else "decode_only"].append(speed)
        kinds["contended" if step.busy else "alone"].append(speed)
    return {kind: (len(speeds), statistics.fmean(speeds) if speeds else None) for kind, speeds in kinds.items()}


def speed_of(step: LoggedStep, profile: StepProfile) -> float:
    """A logged step's time over the profile's model of it, contention included."""
    return step.sample.step_s / (modelled_s(profile, step.sample) * profile.contended(step.busy))
