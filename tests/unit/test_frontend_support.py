"""A scripted FakeRouter (implements RouterAPI) and a FrontendServer on a background event loop,
shared by the front end, client and CLI tests (imported as `test_frontend_support`); plus tests of
the fake itself, so that the other tests stand on a checked footing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.frontend.service import FrontendServer
from cluster.router.api import (
    ClientRequest,
    ClusterView,
    ErrorKind,
    FinalEvent,
    InstanceHealthView,
    InstanceUse,
    InstanceView,
    ModelInfo,
    Outcome,
    RequestEvent,
    RequestView,
    RouterError,
    TimelineEntry,
    TokenEvent,
    Usage,
)
from worker.protocol import InstanceRole

FIXED_TIME_S = 1_700_000_000.25
VOCAB_SIZE = 300
MAX_SEQ_LEN = 64
WAIT_S = 5.0


@dataclass(frozen=True)
class Script:
    """What the fake does with a request whose prompt text is the script's key."""

    tokens: Sequence[tuple[tuple[int, ...], str]] = (((72,), "H"), ((105,), "i"), ((33,), "!"))
    finish_reason: str | None = "length"
    stop_reason: int | str | None = None
    hang: bool = False  # after the tokens, wait until aborted (then end with finish reason "abort")
    submit_error: RouterError | None = None  # refuse at submit
    stream_error: RouterError | None = None  # raise from the event stream after the tokens
    error_kind: ErrorKind | None = None  # end with a FinalEvent carrying this error
    error_message: str = ""
    submit_delay_s: float = 0.0
    no_final: bool = False  # a broken router: the stream ends without a FinalEvent
    gated: bool = False  # each token after the first waits for `FakeRouter.release(request_id)`
    burst: bool = False  # all tokens at once, without yielding to the loop in between


@dataclass
class _Live:
    request_id: str
    request: ClientRequest
    script: Script
    state: str = "QUEUED"
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    final: FinalEvent | None = None


def timeline(*states: str) -> tuple[TimelineEntry, ...]:
    return tuple(
        TimelineEntry(state=state, time_s=FIXED_TIME_S + i * 0.5, instance_id="p0" if i == 1 else "", detail="")
        for i, state in enumerate(states)
    )


INSTANCES = (
    InstanceUse("p0", InstanceRole.PREFILL, "prefill", 1),
    InstanceUse("g0", InstanceRole.GENERATION, "generation", 1),
)


class FakeRouter:
    """RouterAPI with scripted behaviour; a byte-level tokenizer. Records what it was asked."""

    vocab_size = VOCAB_SIZE
    max_seq_len = MAX_SEQ_LEN

    def __init__(self, scripts: dict[str, Script] | None = None) -> None:
        self.scripts = dict(scripts or {})
        self.submitted: list[ClientRequest] = []
        self.aborts: list[tuple[str | None, str | None]] = []
        self.tokenized: list[str] = []
        self._live: dict[str, _Live] = {}
        self._next = 0
        self._cond = threading.Condition()

    # ---- RouterAPI ----

    def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        return list(text.encode("utf-8"))

    async def submit(self, request: ClientRequest) -> _Handle:
        # The front end hands over token ids (it tokenized with tokenize() above: bytes).
        text = request.prompt_text if request.prompt_text is not None else bytes(request.prompt_token_ids or ()).decode("utf-8", "replace")
        script = self.scripts.get(text, Script())
        if script.submit_delay_s:
            await asyncio.sleep(script.submit_delay_s)
        with self._cond:
            self.submitted.append(request)
            self._cond.notify_all()
        if script.submit_error is not None:
            raise script.submit_error
        self._next += 1
        request_id = f"req-{self._next}"
        live = _Live(request_id, request, script)
        self._live[request_id] = live
        return _Handle(request_id, live)

    async def abort(self, request_id: str | None = None, client_request_id: str | None = None) -> tuple[bool, str]:
        live = self._find(request_id, client_request_id)
        with self._cond:
            self.aborts.append((request_id, client_request_id))
            self._cond.notify_all()
        if live.final is not None:
            return False, live.state
        state = live.state
        # Like the real router: an abort ends the request at once, whether or not anyone still
        # reads its events.
        live.final = _final(live, Outcome.ABORTED, "abort", None, "")
        live.state = "ABORTED"
        live.aborted.set()
        return True, state

    def get_request(self, request_id: str | None = None, client_request_id: str | None = None) -> RequestView:
        live = self._find(request_id, client_request_id)
        return RequestView(
            request_id=live.request_id,
            client_request_id=live.request.client_request_id,
            state=live.state,
            timeline=timeline("QUEUED", "CONTEXT_WAIT"),
            instances=INSTANCES[:1],
            final=live.final,
            error=live.final.error_message if live.final is not None else "",
        )

    def cluster_status(self) -> ClusterView:
        return ClusterView(
            instances=(
                InstanceView("p0", InstanceRole.PREFILL, "127.0.0.1:7001", InstanceHealthView.HEALTHY, 90, 128, 7, 1, 2, 1, FIXED_TIME_S - 1.5),
                InstanceView("g0", InstanceRole.GENERATION, "127.0.0.1:7002", InstanceHealthView.DRAINING, 10, 256, 0, 0, 5, 0, FIXED_TIME_S - 0.25),
            ),
            queue_depth=3,
            requests_by_state={"QUEUED": 3, "GENERATING": 5},
            requests_by_outcome={"COMPLETE": 40, "ERROR": 2},
            fallbacks=("retry_transfer", "recompute_local", "fail"),
            max_recovery_attempts=3,
            placement_policy="kv_aware",
            timestamp_s=FIXED_TIME_S,
            model=ModelInfo("built-in", "LlamaForCausalLM", "float32", 2048, 4096),
        )

    # ---- test helpers (thread-safe) ----

    def _find(self, request_id: str | None, client_request_id: str | None) -> _Live:
        for live in self._live.values():
            if request_id is not None and live.request_id == request_id:
                return live
            if client_request_id is not None and live.request.client_request_id == client_request_id:
                return live
        raise RouterError(ErrorKind.NOT_FOUND, f"unknown request {request_id or client_request_id}")

    def wait_for_abort(self, request_id: str, timeout_s: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: (request_id, None) in self.aborts, timeout=timeout_s)

    def wait_for_submits(self, count: int, timeout_s: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.submitted) >= count, timeout=timeout_s)

    def release(self, request_id: str) -> None:
        """Let a gated request produce its next token (from any thread)."""
        live = self._live[request_id]
        live.loop.call_soon_threadsafe(live.gate.release)

    def live_ids(self) -> list[str]:
        return list(self._live)


class _Handle:
    def __init__(self, request_id: str, live: _Live) -> None:
        self.request_id = request_id
        self._live = live

    async def events(self) -> AsyncIterator[RequestEvent]:
        live, script = self._live, self._live.script
        live.state = "GENERATING"
        for index, (token_ids, text) in enumerate(script.tokens):
            if script.gated and index > 0:
                await live.gate.acquire()
            yield TokenEvent(token_ids=token_ids, text=text)
            if not script.burst:
                await asyncio.sleep(0)
        if script.stream_error is not None:
            live.final = _final(live, Outcome.ERROR, None, script.stream_error.kind, script.stream_error.message)
            raise script.stream_error
        if script.no_final:
            return
        if script.hang:
            await live.aborted.wait()
            assert live.final is not None
            yield live.final
            return
        if script.error_kind is not None:
            live.final = _final(live, Outcome.ERROR, None, script.error_kind, script.error_message)
            live.state = "ERROR"
        else:
            live.final = _final(live, Outcome.COMPLETE, script.finish_reason, None, "", script.stop_reason)
            live.state = "COMPLETE"
        yield live.final


def _final(
    live: _Live, outcome: Outcome, finish: str | None, kind: ErrorKind | None, message: str, stop: int | str | None = None
) -> FinalEvent:
    prompt = live.request.prompt_token_ids or tuple(live.request.prompt_text.encode())  # type: ignore[union-attr]
    return FinalEvent(
        outcome=outcome,
        finish_reason=finish,
        stop_reason=stop,
        usage=Usage(len(prompt), sum(len(ids) for ids, _ in live.script.tokens), 2),
        timeline=timeline("QUEUED", "CONTEXT_WAIT", "GENERATING", outcome.value),
        instances=INSTANCES,
        error_kind=kind,
        error_message=message,
    )


class ServerThread:
    """A FrontendServer (and its router) on an event loop of a background thread."""

    def __init__(self, router: Any, **server_kwargs: Any) -> None:
        self.router = router
        self._kwargs = {"port": 0, **server_kwargs}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="frontend-test-loop", daemon=True)
        self.server: FrontendServer | None = None
        self.port = 0

    def call(self, coro: Any, timeout_s: float = WAIT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _start(self) -> int:
        self.server = FrontendServer(self.router, **self._kwargs)
        return await self.server.start()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.port = self.call(self._start())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                self.call(self.server.stop(0.2))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(WAIT_S)
            self._loop.close()


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- tests of the fake ----------------------------------------------------------------------


def _collect(router: FakeRouter, request: ClientRequest) -> tuple[str, list[RequestEvent]]:
    async def run() -> tuple[str, list[RequestEvent]]:
        handle = await router.submit(request)
        return handle.request_id, [event async for event in handle.events()]

    return asyncio.run(run())


def _request(text: str) -> ClientRequest:
    from worker.sampling import SamplingParams

    return ClientRequest(prompt_text=text, prompt_token_ids=None, sampling=SamplingParams())


def test_fake_router_streams_tokens_then_exactly_one_final_event() -> None:
    request_id, events = _collect(FakeRouter(), _request("hello"))
    assert request_id == "req-1"
    assert [type(e).__name__ for e in events] == ["TokenEvent"] * 3 + ["FinalEvent"]
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "length" and final.usage.prompt_tokens == 5


def test_fake_router_hang_script_ends_only_when_aborted() -> None:
    router = FakeRouter({"wait": Script(tokens=(), hang=True)})

    async def run() -> list[RequestEvent]:
        handle = await router.submit(_request("wait"))
        events = handle.events()
        pending = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert not pending.done()
        assert await router.abort(request_id=handle.request_id) == (True, "GENERATING")
        return [await pending]

    (final,) = asyncio.run(run())
    assert isinstance(final, FinalEvent) and final.outcome is Outcome.ABORTED
    with pytest.raises(RouterError) as raised:
        router.get_request(request_id="nope")
    assert raised.value.kind is ErrorKind.NOT_FOUND


def test_server_thread_starts_and_stops_on_a_free_port() -> None:
    started = time.monotonic()
    with ServerThread(FakeRouter()) as server:
        assert server.port > 0
    assert time.monotonic() - started < WAIT_S
