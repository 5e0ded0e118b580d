"""How the router talks to one instance: an async interface, over a Ray actor or in-process.

Every call is one typed Command (worker/protocol.py), encoded, sent to the instance's single entry
point `Instance.handle`, and answered by one encoded Reply. One entry point rather than one actor
method per command: the command's type says what to do, so no method name travels as a string, the
version check and the size limits apply to every call in one place, and the Ray actor and the
in-process instance differ only in how bytes reach `handle` (`_send`).

Every call has a deadline (CONTROL_TIMEOUT_S; CALL_TIMEOUT_S for submit and get_info; a poll or
drain gets its own wait plus CONTROL_TIMEOUT_S). Failures come back as two typed errors, so that the
router can keep client errors out of instance health (a refused input must never trip a breaker):

- `InstanceRejected`: the instance refused the request's input (a client error; names the field).
- `InstanceUnavailable`: the instance is dead, restarting, draining, did not answer in time, or
  speaks another protocol version (it runs other code).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from worker.kv_transfer.failures import FailureReason
from worker.kv_transfer.tls import TlsConfig
from worker.protocol import (
    Abort,
    Ack,
    Command,
    Decoder,
    Drain,
    Drained,
    Encoder,
    GetInfo,
    InstanceInfo,
    Ping,
    Poll,
    PollBatch,
    Pong,
    ProtocolError,
    ProtocolVersionMismatch,
    Push,
    Rejected,
    Release,
    Renew,
    ReplaceTransferTls,
    Reply,
    Submit,
    SubmitRequest,
    Unavailable,
)

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 10.0

R = TypeVar("R")


class InstanceUnavailable(Exception):
    """The instance cannot be reached or is not taking work. `dead`: its process is known to be
    gone (Ray reported the actor dead, or it was killed), not merely late: the router need not wait
    for a bound of silence to recover what it held."""

    def __init__(self, message: str, *, dead: bool = False, late: bool = False) -> None:
        super().__init__(message)
        self.dead = dead
        self.late = late  # no answer within the call's deadline (a loaded machine may just be slow)


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

    async def submit(self, request: SubmitRequest) -> None: ...

    async def abort(self, request_id: str, detail: str) -> None: ...

    async def push(
        self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str
    ) -> None: ...

    async def renew(self, request_ids: tuple[str, ...]) -> None: ...

    async def release(self, request_id: str, reason: FailureReason, detail: str) -> None: ...

    async def poll(self, timeout_s: float) -> PollBatch: ...

    async def drain(self, timeout_s: float) -> int: ...

    # Optional (the router probes only clients that have it):
    # async def probe(self, timeout_s: float, incarnation: str) -> str | None
    #     why the instance is known to be gone, or None when nothing says so (a slow answer says nothing)
    # async def restarted(self) -> bool
    #     a new incarnation answered: hand it what its predecessor's spec could not give it (a
    #     reissued transfer certificate); whether anything was handed over


class _InstanceCalls:
    """The InstanceClient methods, each one deadline-bounded `_call` of a typed command; a subclass
    says how the encoded command reaches the instance (`_send`)."""

    instance_id: str

    def __init__(self, *, issue_certificate: Callable[[str], TlsConfig] | None = None) -> None:
        self._encoder = Encoder()
        self._decoder: Decoder[Reply] = Decoder(Reply)
        # The deployer's CA (DeploymentCa.issue) when the instance's transfers are mutual TLS with
        # generated certificates: a restarted instance gets a fresh certificate from it.
        self._issue_certificate = issue_certificate

    async def _send(self, payload: bytes, name: str, timeout_s: float) -> bytes:
        raise NotImplementedError

    async def _call(self, command: Command, expected: type[R], timeout_s: float = CONTROL_TIMEOUT_S) -> R:
        name = type(command).__name__
        try:
            reply = self._decoder.decode(await self._send(self._encoder.encode(command), name, timeout_s))
        except ProtocolVersionMismatch as error:
            raise InstanceUnavailable(f"{self.instance_id}: {error}") from None
        match reply:
            case Rejected():
                raise InstanceRejected(reply.field, reply.message)
            case Unavailable():
                raise InstanceUnavailable(f"{self.instance_id}: {reply.reason}")
        if not isinstance(reply, expected):
            raise ProtocolError(f"{self.instance_id} answered {name} with {type(reply).__name__}, not {expected.__name__}")
        return reply

    async def get_info(self) -> InstanceInfo:
        return await self._call(GetInfo(), InstanceInfo, timeout_s=CALL_TIMEOUT_S)

    async def ping(self) -> str:
        return (await self._call(Ping(), Pong)).incarnation

    async def probe(self, timeout_s: float, incarnation: str) -> str | None:
        """Why the instance is known to be gone (it refused the Ping, or another incarnation
        answered it), or None when nothing says so: a Ping that is merely slow proves nothing on a
        loaded machine."""
        try:
            answered = (await self._call(Ping(), Pong, timeout_s=timeout_s)).incarnation
        except InstanceUnavailable as error:
            return None if error.late else f"the probe failed: {error}"
        return None if answered == incarnation else "restarted (another incarnation answers)"

    async def restarted(self) -> bool:
        """A new incarnation answered. Ray restarted the actor from its original spec, with its
        predecessor's transfer certificate: issue it a fresh one (when this client holds the
        deployer's CA) and hand it over. Whether a certificate was handed over."""
        if self._issue_certificate is None:
            return False
        tls = await asyncio.to_thread(self._issue_certificate, self.instance_id)  # key generation: ~ms
        await self._call(ReplaceTransferTls(tls), Ack)
        return True

    async def submit(self, request: SubmitRequest) -> None:
        await self._call(Submit(request), Ack, timeout_s=CALL_TIMEOUT_S)

    async def abort(self, request_id: str, detail: str) -> None:
        await self._call(Abort(request_id, detail), Ack)

    async def push(
        self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str
    ) -> None:
        await self._call(Push(request_id, target, transfer_id, float(deadline_s), target_request_id), Ack)

    async def renew(self, request_ids: tuple[str, ...]) -> None:
        await self._call(Renew(tuple(request_ids)), Ack)

    async def release(self, request_id: str, reason: FailureReason, detail: str) -> None:
        await self._call(Release(request_id, reason, detail), Ack)

    async def poll(self, timeout_s: float) -> PollBatch:
        return await self._call(Poll(float(timeout_s)), PollBatch, timeout_s=timeout_s + CONTROL_TIMEOUT_S)

    async def drain(self, timeout_s: float) -> int:
        return (await self._call(Drain(float(timeout_s)), Drained, timeout_s=timeout_s + CONTROL_TIMEOUT_S)).unfinished


class RayInstanceClient(_InstanceCalls):
    """An instance hosted by a Ray actor (worker.instance.Instance wrapped with ray.remote)."""

    def __init__(self, instance_id: str, actor: Any, *, issue_certificate: Callable[[str], TlsConfig] | None = None) -> None:
        super().__init__(issue_certificate=issue_certificate)
        self.instance_id = instance_id
        self.actor = actor

    async def _send(self, payload: bytes, name: str, timeout_s: float) -> bytes:
        import ray

        try:
            return await asyncio.wait_for(self.actor.handle.remote(payload), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise InstanceUnavailable(f"{self.instance_id}: {name} did not answer within {timeout_s:.1f}s", late=True) from None
        except ray.exceptions.ActorUnavailableError as error:
            # Unreachable for now (a network blip, or restarting): a suspicion, confirmed by silence.
            raise InstanceUnavailable(f"{self.instance_id}: {type(error).__name__}") from None
        except ray.exceptions.RayActorError as error:
            # Ray saw the actor's process die: whatever it held is gone, even if it restarts.
            raise InstanceUnavailable(f"{self.instance_id}: {type(error).__name__}", dead=True) from None
        except ray.exceptions.RayTaskError as error:
            raise InstanceUnavailable(f"{self.instance_id}: {name} failed: {error}") from None


    async def probe(self, timeout_s: float, incarnation: str) -> str | None:
        """Ray's own record of the actor first: it knows of a kill or a crash at once, while a call
        in flight to the dead process hangs for about 1.5 s and calls to a restarting actor wait
        for the restart."""
        state = await asyncio.to_thread(ray_actor_state, self.actor)
        if state in ("RESTARTING", "DEAD"):
            return f"Ray reports the actor {state}"
        return await super().probe(timeout_s, incarnation)


def ray_actor_state(actor: Any) -> str | None:
    """The actor's state in Ray's control store ("ALIVE", "RESTARTING", "DEAD", ...), or None when
    it cannot be read. `ray._private.state.actors` is Ray's own accessor behind `ray list actors`;
    the public state API needs the dashboard, which a job cluster may not run, so this reads the
    control store directly and treats any failure as "unknown"."""
    try:
        from ray._private import state

        info = state.actors(actor._actor_id.hex())
    except Exception:  # noqa: BLE001 - a private accessor: unknown rather than wrong
        return None
    value = info.get("State") if isinstance(info, dict) else None
    return value if isinstance(value, str) else None


class LocalInstanceClient(_InstanceCalls):
    """An instance in this process (tests, single-process tools): calls run on worker threads."""

    def __init__(self, instance: Any, *, issue_certificate: Callable[[str], TlsConfig] | None = None) -> None:
        super().__init__(issue_certificate=issue_certificate)
        self.instance = instance
        self.instance_id = instance.spec.instance_id
        self.killed = False

    async def _send(self, payload: bytes, name: str, timeout_s: float) -> bytes:
        if self.killed:
            raise InstanceUnavailable(f"{self.instance_id}: killed", dead=True)
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.instance.handle, payload), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise InstanceUnavailable(f"{self.instance_id}: {name} did not answer within {timeout_s:.1f}s", late=True) from None


class InstantInstanceClient(_InstanceCalls):
    """An InstantInstance (worker/instant.py) on this event loop: no thread; a poll waits for its
    mail on an asyncio.Event instead of blocking. Every call still goes through the real codec."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance
        self.instance_id = instance.instance_id
        self._mail = asyncio.Event()
        instance.on_mail = self._mail.set

    async def poll(self, timeout_s: float) -> PollBatch:
        if not self.instance.has_mail:
            self._mail.clear()
            try:
                await asyncio.wait_for(self._mail.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return await super().poll(0.0)

    async def _send(self, payload: bytes, name: str, timeout_s: float) -> bytes:
        return self.instance.handle(payload)
