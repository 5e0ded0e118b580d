"""Drives a workload through the gRPC client and records when every token arrived.

    runner = LoadRunner(client, SamplingSpec(temperature=0.0, ignore_eos=True))
    await runner.warmup(warmup_requests)
    outcome = await runner.run(requests, PoissonArrivals(4.0), seed=0)
    metrics = compute_metrics(outcome.records, outcome.duration_s, slo)

Poisson arrivals: a dispatcher sends each request at its offset whatever is still in flight (an
open loop, as vLLM). Fixed concurrency: that many workers, each sending its next request when its
last one ends (a closed loop). A multi-turn request waits for the turn it follows to end and then
sends that turn's prompt and output followed by its own tokens; its latencies start when it is
sent. A failed request is recorded with its gRPC status, never retried; the turns after a failed
one are recorded as skipped. The clock and sleep are injected so tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.client import Delta, DuetError, Result
from cluster.loadgen.arrivals import Arrivals, FixedConcurrency, PoissonArrivals, ScheduledArrivals
from cluster.loadgen.metrics import BenchMetrics, RequestRecord, Slo, compute_metrics
from cluster.loadgen.workloads import BenchRequest

logger = logging.getLogger(__name__)

SKIPPED = "SKIPPED"  # the error kind of a turn whose previous turn failed
DEFAULT_WARMUP_CONCURRENCY = 4


class RunnerError(RuntimeError):
    """A workload the runner cannot drive (a bug in how it was built, not a server failure)."""


class GenerateClient(Protocol):
    """What the runner needs of a client: AsyncDuetClient.generate."""

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Any]: ...


@dataclass(frozen=True)
class SamplingSpec:
    """How every request samples. Greedy with ignore_eos by default, so that output lengths are
    the workload's."""

    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = 300.0  # each request's own deadline
    seed: int | None = None

    def kwargs(self, max_tokens: int) -> dict[str, Any]:
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "timeout_s": self.timeout_s,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class RunOutcome:
    records: tuple[RequestRecord, ...]  # in workload order
    duration_s: float  # from the first send to the last response
    max_send_lag_s: float  # worst delay of a send behind its schedule (a client-side bottleneck)


@dataclass(frozen=True)
class PointResult:
    """One measured point (of a sweep, or one side of a comparison): the arrival process, what was
    recorded, and its metrics."""

    arrivals: Arrivals
    outcome: RunOutcome
    metrics: BenchMetrics


def merge_outcomes(outcomes: Sequence[RunOutcome]) -> RunOutcome:
    """Several runs of one setting as one: records pooled, durations added (so throughputs are
    totals over total time, and percentiles are over every request)."""
    if not outcomes:
        raise RunnerError("nothing to merge")
    return RunOutcome(
        records=tuple(record for outcome in outcomes for record in outcome.records),
        duration_s=sum(outcome.duration_s for outcome in outcomes),
        max_send_lag_s=max(outcome.max_send_lag_s for outcome in outcomes),
    )


class LoadRunner:
    def __init__(
        self,
        client: GenerateClient,
        sampling: SamplingSpec = SamplingSpec(),
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_done: Callable[[RequestRecord], None] | None = None,
        on_first_token: Callable[[int], None] | None = None,
    ) -> None:
        self._client = client
        self._sampling = sampling
        self._clock = clock
        self._sleep = sleep
        self._on_done = on_done
        self._on_first_token = on_first_token  # (request index), as its first tokens arrive

    async def warmup(
        self, requests: Sequence[BenchRequest], concurrency: int = DEFAULT_WARMUP_CONCURRENCY
    ) -> tuple[RequestRecord, ...]:
        """Send requests that are not measured (first-call costs: channels, allocator, caches)."""
        if not requests:
            return ()
        outcome = await self._run(requests, FixedConcurrency(min(concurrency, len(requests))), seed=0, report=False)
        return outcome.records

    async def run(self, requests: Sequence[BenchRequest], arrivals: Arrivals, *, seed: int = 0) -> RunOutcome:
        """Send `requests` as `arrivals` says; `seed` seeds the arrival times."""
        return await self._run(requests, arrivals, seed=seed, report=True)

    async def _run(self, requests: Sequence[BenchRequest], arrivals: Arrivals, *, seed: int, report: bool) -> RunOutcome:
        by_index = {request.index: position for position, request in enumerate(requests)}
        if len(by_index) != len(requests):
            raise RunnerError("request indexes must be unique")
        for position, request in enumerate(requests):
            if request.after is not None:
                if by_index.get(request.after, position) >= position:
                    raise RunnerError(f"request {request.index} follows {request.after}, which is not sent before it")
                if isinstance(request.prompt, str):
                    raise RunnerError(f"request {request.index}: a follow-up turn needs a token-id prompt")
        loop = asyncio.get_running_loop()
        histories: dict[int, asyncio.Future[tuple[int, ...] | None]] = {r.index: loop.create_future() for r in requests}
        records: dict[int, RequestRecord] = {}
        run = _Run(self, histories, records, report)
        started_s = self._clock()
        run.started_s = started_s
        if isinstance(arrivals, (PoissonArrivals, ScheduledArrivals)):
            await run.open_loop(requests, arrivals.offsets_s(len(requests), seed))
        elif isinstance(arrivals, FixedConcurrency):
            await run.closed_loop(requests, arrivals.concurrency)
        else:
            raise RunnerError(f"unknown arrival process {arrivals!r}")
        duration_s = max(self._clock() - started_s, 1e-9)
        return RunOutcome(tuple(records[r.index] for r in requests), duration_s, run.max_send_lag_s)


class _Run:
    """The state of one run: histories of multi-turn conversations and the records so far."""

    def __init__(
        self,
        runner: LoadRunner,
        histories: dict[int, asyncio.Future[tuple[int, ...] | None]],
        records: dict[int, RequestRecord],
        report: bool,
    ) -> None:
        self.runner = runner
        self.histories = histories
        self.records = records
        self.report = report
        self.started_s = 0.0
        self.max_send_lag_s = 0.0

    def now_s(self) -> float:
        return self.runner._clock() - self.started_s

    async def open_loop(self, requests: Sequence[BenchRequest], offsets_s: Sequence[float]) -> None:
        tasks = []
        for request, offset_s in zip(requests, offsets_s, strict=True):
            wait_s = offset_s - self.now_s()
            if wait_s > 0:
                await self.runner._sleep(wait_s)
            self.max_send_lag_s = max(self.max_send_lag_s, self.now_s() - offset_s)
            tasks.append(asyncio.ensure_future(self.one(request, offset_s)))
        await asyncio.gather(*tasks)

    async def closed_loop(self, requests: Sequence[BenchRequest], concurrency: int) -> None:
        queue = iter(requests)

        async def worker() -> None:
            for request in queue:  # a shared iterator: each request goes to exactly one worker
                await self.one(request, None)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))

    async def one(self, request: BenchRequest, scheduled_s: float | None) -> None:
        history: tuple[int, ...] | None = None
        try:
            record, history = await self._send(request, scheduled_s)
        finally:
            future = self.histories[request.index]
            if not future.done():
                future.set_result(history)  # None wakes the next turn to record itself skipped
        self.records[request.index] = record
        if self.report and self.runner._on_done is not None:
            self.runner._on_done(record)

    async def _send(self, request: BenchRequest, scheduled_s: float | None) -> tuple[RequestRecord, tuple[int, ...] | None]:
        prompt: str | tuple[int, ...] = request.prompt
        base = {
            "index": request.index,
            "scheduled_s": scheduled_s,
            "conversation": request.conversation,
            "turn": request.turn,
            "expected_output_tokens": request.max_tokens,
        }
        if request.after is not None:
            previous = await self.histories[request.after]
            if previous is None:
                now_s = self.now_s()
                error = f"{SKIPPED}: turn {request.turn - 1} of conversation {request.conversation} failed"
                return RequestRecord(sent_s=now_s, end_s=now_s, error=error, **base), None
            assert not isinstance(request.prompt, str)  # checked before the run
            prompt = previous + request.prompt
        chunk_times_s: list[float] = []
        chunk_tokens: list[int] = []
        output_ids: list[int] = []
        result: Result | None = None
        sent_s = self.now_s()
        events = self.runner._client.generate(prompt, **self.runner._sampling.kwargs(request.max_tokens))
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    arrived_s = self.now_s()
                    if isinstance(event, Delta):
                        if event.token_ids:
                            if not chunk_times_s and self.report and self.runner._on_first_token is not None:
                                self.runner._on_first_token(request.index)
                            chunk_times_s.append(arrived_s)
                            chunk_tokens.append(len(event.token_ids))
                            output_ids.extend(event.token_ids)
                    elif isinstance(event, Result):
                        result = event
        except DuetError as error:
            end_s = self.now_s()
            logger.debug("request %d failed: %s", request.index, error)
            return (
                RequestRecord(
                    sent_s=sent_s,
                    end_s=end_s,
                    chunk_times_s=tuple(chunk_times_s),
                    chunk_tokens=tuple(chunk_tokens),
                    output_tokens=len(output_ids),
                    error=f"{error.code.name}: {error.message}",
                    **base,
                ),
                None,
            )
        end_s = self.now_s()
        if result is None:
            raise RunnerError(f"request {request.index}: the stream ended without a result")
        record = RequestRecord(
            sent_s=sent_s,
            end_s=end_s,
            chunk_times_s=tuple(chunk_times_s),
            chunk_tokens=tuple(chunk_tokens),
            prompt_tokens=result.usage.prompt_tokens,
            output_tokens=result.usage.completion_tokens,
            cached_tokens=result.usage.cached_tokens,
            finish_reason=result.finish_reason,
            instances=result.instances,
            **base,
        )
        full_prompt = prompt if not isinstance(prompt, str) else None
        return record, (tuple(full_prompt) + tuple(output_ids)) if full_prompt is not None else None


async def measure_point(
    runner: LoadRunner, requests: Sequence[BenchRequest], arrivals: Arrivals, *, seed: int, slo: Slo | None = None
) -> PointResult:
    outcome = await runner.run(requests, arrivals, seed=seed)
    return PointResult(arrivals, outcome, compute_metrics(outcome.records, outcome.duration_s, slo or Slo()))
