"""An OpenAI HTTP front end on 127.0.0.1 over the real router, on an event loop of its own thread,
so that the synchronous openai client can call it from the test's thread.

Backed by instant instances (worker/instant.py: no model, every token at once) by default, or by
any `instances(router)` coroutine (tests/integration: real engines)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from cluster.frontend.http import OpenAIServer
from cluster.router.config import RouterConfig
from cluster.router.driver import Router
from cluster.router.instance_client import InstantInstanceClient
from worker.instant import InstantInstance, InstantNetwork
from worker.protocol import InstanceRole
from worker.tokenizer import ByteTokenizer

MODEL = "duet-default"


async def instant_pair(router: Router) -> None:
    network = InstantNetwork()
    for name, role in (("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION)):
        await router.add_instance(InstantInstanceClient(InstantInstance(name, role, network)))


class ServerThread:
    def __init__(
        self,
        *,
        instances: Callable[[Router], Awaitable[Any]] = instant_pair,
        router_config: dict | None = None,
        max_seq_len: int = 4096,
        tokenizer: Any = None,
        vocab_size: int = 264,
        **server_options: Any,
    ) -> None:
        self._tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self._vocab_size = vocab_size
        self._instances = instances
        self._router_config = {"health": {"heartbeat_interval_s": 0.05, "dead_after_s": 5.0}, **(router_config or {})}
        self._max_seq_len = max_seq_len
        self._options = server_options
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.router: Router | None = None
        self.server: OpenAIServer | None = None
        self.cleanup: Any = None

    def call(self, coro: Awaitable[Any], timeout_s: float = 60.0) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return future.result(timeout_s)

    async def _start(self) -> None:
        config = RouterConfig.from_dict(self._router_config)
        self.router = Router(
            config, self._tokenizer, vocab_size=self._vocab_size, max_seq_len=self._max_seq_len, tokens_per_block=16, seed=7
        )
        await self.router.start()
        self.cleanup = await self._instances(self.router)
        options = {"served_model_name": MODEL, "port": 0, **self._options}
        self.server = OpenAIServer(self.router, self._tokenizer, **options)
        await self.server.start()

    async def _stop(self) -> None:
        assert self.server is not None and self.router is not None
        await self.server.stop(1.0)
        await self.router.stop()
        if self.cleanup is not None:
            await self.cleanup()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port
