"""The router as the load runner's client: `generate` in, the SDK's Delta / Result events out.

cluster/loadgen/runner.py drives a `GenerateClient` (AsyncDuetClient in `duet bench`); here the
same runner drives the router directly, so a simulation measures exactly what `duet bench` measures
minus the gRPC front end, which it models as a one-way latency per message, `frontend_latency_s`
(cluster/sim/cluster.py SimSettings; 0 by default): a request reaches `Router.submit` that long
after the runner sends it, and each event reaches the runner that long after the router emitted
it (a constant delay: events do not queue behind each other's delay). A request that ends in error
raises DuetError with the gRPC status the front end would send (cluster/frontend/service.py
`status_code_for`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cluster.client import Delta, DuetError, Result
from cluster.client.sdk import InstanceWork, Usage
from cluster.router.api import ClientRequest, FinalEvent, Outcome, RouterError
from worker.sampling import SamplingParams


class RouterClient:
    def __init__(self, router: Any, frontend_latency_s: float = 0.0) -> None:
        self.router = router
        self.frontend_latency_s = frontend_latency_s
        self._seed = 0

    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Delta | Result]:
        if isinstance(prompt, str):
            token_ids = tuple(self.router.tokenize(prompt))
        else:
            token_ids = tuple(prompt)
        timeout_s = kwargs.pop("timeout_s", None)
        if kwargs.get("seed") is None:
            self._seed += 1  # the runner leaves seeds to the server: a stable one per request here
            kwargs["seed"] = self._seed
        params = SamplingParams(**kwargs)
        request = ClientRequest(None, token_ids, params, timeout_s=timeout_s, validated=True)
        if self.frontend_latency_s:
            await asyncio.sleep(self.frontend_latency_s)
        try:
            handle = await self.router.submit(request)
        except RouterError as error:
            raise DuetError(grpc.StatusCode[error.kind.value], error.message) from None
        events = handle.events() if not self.frontend_latency_s else _delayed(handle.events(), self.frontend_latency_s)
        async for event in events:
            if isinstance(event, FinalEvent):
                result = Result(
                    handle.request_id,
                    event.finish_reason,
                    event.stop_reason,
                    Usage(event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens),
                    (),
                    tuple(InstanceWork(u.instance_id, u.role.name, u.phase, u.attempt) for u in event.instances),
                )
                if event.outcome is not Outcome.COMPLETE:
                    kind = event.error_kind.value if event.error_kind is not None else "INTERNAL"
                    raise DuetError(grpc.StatusCode[kind], event.error_message, request_id=handle.request_id, result=result)
                yield result
                return
            yield Delta(handle.request_id, event.token_ids, event.text)


async def _delayed(events: AsyncIterator[Any], delay_s: float) -> AsyncIterator[Any]:
    """`events`, each `delay_s` after the router emitted it: a pump task stamps them as they come."""
    loop = asyncio.get_running_loop()
    stamped: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                stamped.put_nowait((loop.time() + delay_s, event))
        finally:
            stamped.put_nowait(None)

    task = asyncio.ensure_future(pump())
    try:
        while (item := await stamped.get()) is not None:
            due_s, event = item
            if due_s > loop.time():
                await asyncio.sleep(due_s - loop.time())
            yield event
        await task  # its exception, if the events ended in one
    finally:
        task.cancel()
