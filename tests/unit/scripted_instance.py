"""A scripted instance for router tests without engines: the test feeds its poll batches and can hold
any of its calls, so that an interleaving of the router's tasks is chosen by the test, not by timing.

    p0 = ScriptedInstance("p0", InstanceRole.PREFILL)
    await router.add_instance(p0)
    p0.hold("release")                       # the next release call waits...
    p0.report(push_results=(...,))           # ...the router reacts to this batch...
    await p0.arrived("release")              # ...and is now inside that call
    p0.let_go("release")

It speaks the router's InstanceClient interface with the real message types (a submitted request
goes through the wire codec, as it would to an instance). Calls are recorded in the order the
instance *finishes* them, which is the order an instance would act on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cluster.router.instance_client import InstanceUnavailable
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason
from worker.protocol import Decoder, Encoder, InstanceInfo, InstanceRole, PollBatch, Submit, SubmitRequest

VOCAB_SIZE = 264
TOKENS_PER_BLOCK = 16
_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TOKENS_PER_BLOCK, dtype="float32", model_fingerprint="scripted")


class ScriptedInstance:
    def __init__(self, instance_id: str, role: InstanceRole, *, num_blocks: int = 64, port: int = 1) -> None:
        self.instance_id = instance_id
        self.info = InstanceInfo(
            instance_id=instance_id,
            role=role,
            incarnation="incarnation-1",
            transfer_address=f"127.0.0.1:{port}",
            layout=_LAYOUT,
            num_blocks=num_blocks,
            vocab_size=VOCAB_SIZE,
            max_seq_len=4096,
            pid=0,
            device="cpu",
        )
        self.calls: list[tuple[str, str]] = []  # (method, engine request id), in finishing order
        self.submits: dict[str, SubmitRequest] = {}
        self._batches: asyncio.Queue[PollBatch] = asyncio.Queue()
        self._sequence = 0
        self._holds: dict[str, asyncio.Event] = {}
        self._failing: dict[str, BaseException | None] = {}
        self._arrivals: dict[str, asyncio.Event] = {}

    # --- what the test does ---------------------------------------------------------------------------
    def report(self, **fields) -> None:
        """The next poll returns a batch with these fields (outputs=, events=, reservations=, ...)."""
        self._sequence += 1
        self._batches.put_nowait(PollBatch(incarnation=self.info.incarnation, sequence=self._sequence, **fields))

    def hold(self, method: str) -> None:
        """Calls of `method` wait until `let_go(method)`."""
        self._holds[method] = asyncio.Event()
        self._arrivals[method] = asyncio.Event()

    async def arrived(self, method: str, timeout_s: float = 10.0) -> None:
        """Wait until a held call of `method` has arrived."""
        await asyncio.wait_for(self._arrivals[method].wait(), timeout_s)

    def fail(self, method: str, error: BaseException | None = None) -> None:
        """Calls of `method` fail as if the instance could not be reached (or with `error`, as a
        refusal or a bug would), until `heal(method)`."""
        self._failing[method] = error

    def heal(self, method: str) -> None:
        self._failing.pop(method, None)

    def let_go(self, method: str) -> None:
        self._holds.pop(method).set()

    def called(self, method: str, request_id: str | None = None) -> bool:
        return any(m == method and (request_id is None or r == request_id) for m, r in self.calls)

    # --- InstanceClient ------------------------------------------------------------------------------
    async def _call(self, method: str, request_id: str) -> None:
        if method in self._failing:
            raise self._failing[method] or InstanceUnavailable(f"{self.instance_id}: {method} failed (scripted)")
        gate = self._holds.get(method)
        if gate is not None:
            self._arrivals[method].set()
            await gate.wait()
        self.calls.append((method, request_id))

    async def get_info(self) -> InstanceInfo:
        return self.info

    async def ping(self) -> str:
        return self.info.incarnation

    async def submit(self, request: SubmitRequest) -> None:
        submit = Decoder(Submit).decode(Encoder().encode(Submit(request))).request
        await self._call("submit", submit.request_id)
        self.submits[submit.request_id] = submit

    async def abort(self, request_id: str, detail: str) -> None:
        await self._call("abort", request_id)

    async def release(self, request_id: str, reason: FailureReason, detail: str) -> None:
        await self._call("release", request_id)

    async def push(self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str) -> None:
        await self._call("push", request_id)

    async def poll(self, timeout_s: float) -> PollBatch:
        try:
            return await asyncio.wait_for(self._batches.get(), timeout_s)
        except asyncio.TimeoutError:
            self._sequence += 1
            return PollBatch(incarnation=self.info.incarnation, sequence=self._sequence)

    async def drain(self, timeout_s: float) -> int:
        return 0


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Let the router's tasks run until `condition` holds (fails after timeout_s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("the router never got there")
        await asyncio.sleep(0.001)
