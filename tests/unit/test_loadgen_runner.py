"""The load runner on a virtual clock with a fake client: send times follow the arrival process,
token arrival times become the record's timings, concurrency is bounded, multi-turn requests resend
their history, failures are recorded (and skip later turns), warm-up is not reported."""

from __future__ import annotations

import asyncio
import heapq
import itertools

import grpc
import pytest

from cluster.client import Delta, DuetError, InstanceWork, Result, Usage
from cluster.loadgen.arrivals import FixedConcurrency, PoissonArrivals
from cluster.loadgen.metrics import Slo
from cluster.loadgen.runner import (
    SKIPPED,
    LoadRunner,
    RunnerError,
    SamplingSpec,
    measure_point,
    merge_outcomes,
)
from cluster.loadgen.workloads import BenchRequest, WorkloadConfig, WorkloadKind, build_workload

TTFT_S = 0.25
ITL_S = 0.05


class VirtualTime:
    """A clock that only moves when every task is blocked on a virtual sleep."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []
        self._counter = itertools.count()

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now_s + max(0.0, seconds), next(self._counter), future))
        await future

    async def drive(self, main) -> object:
        task = asyncio.ensure_future(main)
        while not task.done():
            for _ in range(50):  # let every runnable task run until it blocks
                await asyncio.sleep(0)
            if task.done():
                break
            if not self._sleepers:
                raise AssertionError("deadlock: nothing sleeps and the run is not done")
            wake_s, _, future = heapq.heappop(self._sleepers)
            self.now_s = wake_s
            future.set_result(None)
        return task.result()


class FakeClient:
    """Streams max_tokens tokens (ids 1000 + position), first after TTFT_S, then every ITL_S."""

    def __init__(self, time: VirtualTime, fail_prompts: frozenset[int] = frozenset()) -> None:
        self.time = time
        self.fail_prompts = fail_prompts  # requests whose prompt ends with one of these tokens fail
        self.calls: list[tuple[float, tuple, dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, prompt, **kwargs):
        self.calls.append((self.time.now_s, tuple(prompt), kwargs))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.time.sleep(TTFT_S)
            if prompt[-1] in self.fail_prompts:
                raise DuetError(grpc.StatusCode.INTERNAL, "injected failure")
            for position in range(kwargs["max_tokens"]):
                if position:
                    await self.time.sleep(ITL_S)
                yield Delta("r", (1000 + position,), "x")
            yield Result("r", "length", None, Usage(len(prompt), kwargs["max_tokens"], 3), (), (InstanceWork("p0", "PREFILL", "prefill"),))
        finally:
            self.in_flight -= 1


def run(time: VirtualTime, coro):
    return asyncio.run(time.drive(coro))


def fixed(count: int, output_len: int = 4) -> tuple[BenchRequest, ...]:
    return build_workload(WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=count, input_len=8, output_len=output_len), seed=0)


def test_open_loop_sends_on_schedule_and_times_every_token() -> None:
    time = VirtualTime()
    client = FakeClient(time)
    arrivals = PoissonArrivals(2.0)
    requests = fixed(6)
    result = run(time, measure_point(LoadRunner(client, clock=time.clock, sleep=time.sleep), requests, arrivals, seed=5, slo=Slo(ttft_ms=300)))
    offsets = arrivals.offsets_s(6, seed=5)
    records = result.outcome.records
    assert [r.index for r in records] == [r.index for r in requests]
    assert [r.sent_s for r in records] == pytest.approx(offsets)
    assert [r.scheduled_s for r in records] == pytest.approx(offsets)
    assert [call[0] for call in client.calls] == pytest.approx(offsets)
    for r in records:
        assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 8 and r.cached_tokens == 3
        assert r.ttft_s == pytest.approx(TTFT_S)
        assert r.itls_s == pytest.approx((ITL_S,) * 3)
        assert r.tpot_s == pytest.approx(ITL_S)
        assert r.instance_names == ("prefill@p0",)
    # Open loop: requests overlap when the schedule says so; the run lasts until the last one ends.
    assert result.outcome.duration_s == pytest.approx(offsets[-1] + TTFT_S + 3 * ITL_S)
    assert result.outcome.max_send_lag_s == pytest.approx(0.0)
    assert result.metrics.completed == 6 and result.metrics.good_requests == 6


def test_sampling_is_greedy_ignore_eos_by_default() -> None:
    time = VirtualTime()
    client = FakeClient(time)
    run(time, LoadRunner(client, clock=time.clock, sleep=time.sleep).run(fixed(1, output_len=2), FixedConcurrency(1)))
    assert client.calls[0][2] == {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "timeout_s": 300.0, "seed": None}
    assert SamplingSpec(temperature=0.7, ignore_eos=False, timeout_s=None, seed=3).kwargs(5) == {
        "max_tokens": 5, "temperature": 0.7, "ignore_eos": False, "timeout_s": None, "seed": 3}


def test_fixed_concurrency_keeps_that_many_in_flight() -> None:
    time = VirtualTime()
    client = FakeClient(time)
    outcome = run(time, LoadRunner(client, clock=time.clock, sleep=time.sleep).run(fixed(7), FixedConcurrency(3)))
    assert client.max_in_flight == 3
    per_request_s = TTFT_S + 3 * ITL_S
    # 7 requests, 3 at a time, all the same length: three waves.
    assert outcome.duration_s == pytest.approx(3 * per_request_s)
    assert sorted(r.sent_s for r in outcome.records) == pytest.approx([0, 0, 0, per_request_s, per_request_s, per_request_s, 2 * per_request_s])
    assert all(r.scheduled_s is None for r in outcome.records)


def test_multi_turn_resends_history_and_waits_for_the_previous_turn() -> None:
    time = VirtualTime()
    client = FakeClient(time)
    requests = build_workload(WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=4, turns=2, input_len=3, output_len=2), seed=0)
    outcome = run(time, LoadRunner(client, clock=time.clock, sleep=time.sleep).run(requests, PoissonArrivals(1000.0)))
    prompts = {call[1]: call[0] for call in client.calls}
    by_index = {r.index: r for r in requests}
    for r in requests:
        if r.after is None:
            continue
        first = by_index[r.after]
        expected_prompt = first.prompt + (1000, 1001) + r.prompt
        assert expected_prompt in prompts
        # Sent only once the first turn ended (its TTFT plus one ITL), whatever the rate says.
        assert prompts[expected_prompt] >= prompts[first.prompt] + TTFT_S + ITL_S - 1e-9
    records = {rec.index: rec for rec in outcome.records}
    assert records[requests[-1].index].prompt_tokens == 3 + 2 + 3


def test_failures_are_recorded_and_skip_later_turns() -> None:
    time = VirtualTime()
    requests = build_workload(WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=4, turns=2, input_len=3, output_len=2), seed=0)
    doomed = requests[0]  # the first turn of conversation 0
    client = FakeClient(time, fail_prompts=frozenset({doomed.prompt[-1]}))
    outcome = run(time, LoadRunner(client, clock=time.clock, sleep=time.sleep).run(requests, FixedConcurrency(4)))
    records = {r.index: r for r in outcome.records}
    assert records[doomed.index].error == "INTERNAL: injected failure"
    follower = next(r for r in requests if r.after == doomed.index)
    assert records[follower.index].error.startswith(SKIPPED)
    assert sum(r.ok for r in outcome.records) == 2


def test_warmup_is_not_reported_and_merge_pools_rounds() -> None:
    time = VirtualTime()
    seen = []
    runner = LoadRunner(FakeClient(time), clock=time.clock, sleep=time.sleep, on_done=seen.append)
    warm = run(time, runner.warmup(fixed(3)))
    assert len(warm) == 3 and seen == []
    first = run(time, runner.run(fixed(2), FixedConcurrency(2)))
    second = run(time, runner.run(fixed(3), FixedConcurrency(1)))
    assert len(seen) == 5
    merged = merge_outcomes([first, second])
    assert len(merged.records) == 5 and merged.duration_s == pytest.approx(first.duration_s + second.duration_s)


def test_bad_workloads_are_refused() -> None:
    time = VirtualTime()
    runner = LoadRunner(FakeClient(time), clock=time.clock, sleep=time.sleep)
    with pytest.raises(RunnerError, match="unique"):
        run(time, runner.run((BenchRequest(0, (1,), 1), BenchRequest(0, (2,), 1)), FixedConcurrency(1)))
    with pytest.raises(RunnerError, match="not sent before"):
        run(time, runner.run((BenchRequest(0, (1,), 1, after=1), BenchRequest(1, (2,), 1)), FixedConcurrency(1)))
    with pytest.raises(RunnerError, match="token-id prompt"):
        run(time, runner.run((BenchRequest(0, (1,), 1), BenchRequest(1, "text", 1, after=0)), FixedConcurrency(1)))
