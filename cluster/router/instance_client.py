"""How the router talks to one instance: an async interface, over a Ray actor or in-process.

Every call has a deadline. Failures come back as two typed errors, so that the router can keep
client errors out of instance health (peers.md: 4xx answers must never trip a breaker):

- `InstanceRejected`: the instance refused the request's input (a client error; names the field).
- `InstanceUnavailable`: the instance is dead, restarting, draining or did not answer in time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from worker.instance_protocol import InstanceInfo, PollBatch, decode_info, decode_poll

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 10.0


class InstanceUnavailable(Exception):
    """The instance cannot be reached or is not taking work."""


class InstanceRejected(Exception):
    """The instance refused the input of a request (a client error, never a health signal)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InstanceClient(Protocol):
    instance_id: str

    async def get_info(self) -> InstanceInfo: ...

    async def ping(self) -> str: ...

    async def submit(self, payload: bytes) -> None: ...

    async def abort(self, request_id: str, detail: str) -> None: ...

    async def push(
        self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str
    ) -> None: ...

    async def release(self, request_id: str, reason: str, detail: str) -> None: ...

    async def poll(self, timeout_s: float) -> PollBatch: ...

    async def drain(self, timeout_s: float) -> int: ...


def _rejection(error: BaseException) -> InstanceRejected | None:
    from worker.engine_types import EngineInputError
    from worker.sampling import InvalidSamplingParams

    cause = error
    for _ in range(4):  # Ray wraps the actor's exception (RayTaskError -> cause)
        if isinstance(cause, (EngineInputError, InvalidSamplingParams)):
            return InstanceRejected(cause.field, cause.message)
        nested = getattr(cause, "cause", None) or cause.__cause__
        if nested is None or nested is cause:
            break
        cause = nested
    return None


class _InstanceCalls:
    """The InstanceClient methods, each one deadline-bounded `_call` of the instance's method of
    the same name; a subclass says how a call reaches the instance."""

    instance_id: str

    async def _call(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        raise NotImplementedError

    async def get_info(self) -> InstanceInfo:
        return decode_info(await self._call("get_info", timeout_s=CALL_TIMEOUT_S))

    async def ping(self) -> str:
        return await self._call("ping")

    async def submit(self, payload: bytes) -> None:
        await self._call("submit", payload, timeout_s=CALL_TIMEOUT_S)

    async def abort(self, request_id: str, detail: str) -> None:
        await self._call("abort", request_id, detail)

    async def push(
        self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str
    ) -> None:
        await self._call("push", request_id, target, transfer_id, deadline_s, target_request_id)

    async def release(self, request_id: str, reason: str, detail: str) -> None:
        await self._call("release", request_id, reason, detail)

    async def poll(self, timeout_s: float) -> PollBatch:
        return decode_poll(await self._call("poll", timeout_s, timeout_s=timeout_s + CONTROL_TIMEOUT_S))

    async def drain(self, timeout_s: float) -> int:
        return await self._call("drain", timeout_s, timeout_s=timeout_s + CONTROL_TIMEOUT_S)


class RayInstanceClient(_InstanceCalls):
    """An instance hosted by a Ray actor (worker.instance.Instance wrapped with ray.remote)."""

    def __init__(self, instance_id: str, actor: Any) -> None:
        self.instance_id = instance_id
        self.actor = actor

    async def _call(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        import ray

        try:
            ref = getattr(self.actor, method).remote(*args)
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except asyncio.TimeoutError:
            raise InstanceUnavailable(f"{self.instance_id}: {method} did not answer within {timeout_s:.1f}s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
            raise InstanceUnavailable(f"{self.instance_id}: {type(error).__name__}") from None
        except ray.exceptions.RayTaskError as error:
            rejection = _rejection(error)
            if rejection is not None:
                raise rejection from None
            raise InstanceUnavailable(f"{self.instance_id}: {method} failed: {error}") from None


class LocalInstanceClient(_InstanceCalls):
    """An instance in this process (tests, single-process tools): calls run on worker threads."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.instance_id = instance.spec.instance_id
        self.killed = False

    async def _call(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        from worker.instance import InstanceError

        if self.killed:
            raise InstanceUnavailable(f"{self.instance_id}: killed")
        try:
            return await asyncio.wait_for(asyncio.to_thread(getattr(self.instance, method), *args), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise InstanceUnavailable(f"{self.instance_id}: {method} did not answer within {timeout_s:.1f}s") from None
        except InstanceError as error:
            raise InstanceUnavailable(f"{self.instance_id}: {error}") from None
        except Exception as error:
            rejection = _rejection(error)
            if rejection is not None:
                raise rejection from None
            raise
