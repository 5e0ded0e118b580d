"""One serving instance as a process-level object: the engine, its step loop thread, its KV transfer
server (receiver) and sender, and a mailbox the router polls.

This is the facade a Ray actor wraps (cluster/launch.py does `ray.remote(Instance)`); it is a plain
class, so tests drive it in-process too. Every method takes and returns plain values or msgpack
bytes (worker/instance_protocol.py): nothing pickled crosses it by design.

Threads: the loop thread owns the engine. Calls from the router (submit, abort, push, release,
poll) arrive on other threads; they post commands the loop runs between steps, and `poll` waits on
the mailbox. Pushes run on a small thread pool and report back through the engine's inbox.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from worker.engine_types import EngineConfig, EngineInputError, InstanceRole
from worker.instance_protocol import (
    InstanceInfo,
    PollBatch,
    PushResult,
    ReservationNotice,
    decode_submit,
    encode_info,
    encode_poll,
)
from worker.kv_transfer.config import ReceiverConfig, SenderConfig, TransportSecurity
from worker.kv_transfer.failures import FailureReason, TransferFailure
from worker.kv_transfer.faults import FaultInjector
from worker.sampling import InvalidSamplingParams

logger = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 30.0


class InstanceError(RuntimeError):
    """The instance cannot do what was asked (stopped, draining, bad spec)."""


@dataclass(frozen=True)
class InstanceSpec:
    """How to build one instance (plain data: it travels to the actor as msgpack)."""

    instance_id: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    device: str = "auto"
    transfer_host: str = "127.0.0.1"  # "auto": this node's Ray address (loopback outside Ray)
    transfer_port: int = 0
    cluster_token: str | None = None
    torch_threads: int | None = None
    faults: Mapping[str, Any] | None = None
    push_threads: int = 2
    sender: Mapping[str, Any] | None = None  # SenderConfig fields
    receiver: Mapping[str, Any] | None = None  # ReceiverConfig fields (host/port come from above)

    @property
    def role(self) -> InstanceRole:
        return self.engine.role

    def to_bytes(self) -> bytes:
        engine = {name: getattr(self.engine, name) for name in self.engine.__dataclass_fields__}
        for name, value in list(engine.items()):
            if hasattr(value, "value"):
                engine[name] = value.value
        return msgpack.packb(
            {
                "instance_id": self.instance_id,
                "engine": engine,
                "model": self.model,
                "dtype": self.dtype,
                "device": self.device,
                "transfer_host": self.transfer_host,
                "transfer_port": self.transfer_port,
                "cluster_token": self.cluster_token,
                "torch_threads": self.torch_threads,
                "faults": dict(self.faults) if self.faults else None,
                "push_threads": self.push_threads,
                "sender": dict(self.sender) if self.sender else None,
                "receiver": dict(self.receiver) if self.receiver else None,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> InstanceSpec:
        raw = msgpack.unpackb(data, raw=False)
        engine = dict(raw.pop("engine"))
        config = EngineConfig().with_overrides(**engine)
        return cls(engine=config, **raw)


def _bind_host(host: str) -> str:
    if host != "auto":
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: loopback
        pass
    return "127.0.0.1"


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray: the hostname
        pass
    import socket

    return socket.gethostname()


class _EngineSink:
    """TransferSink over the engine (open() runs on the transfer server's threads)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def open(self, transfer_id: str, request_id: str, peer_layout):
        return self._engine.open_transfer(transfer_id, request_id, peer_layout)


class Instance:
    def __init__(self, spec: bytes | InstanceSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        from worker.engine import Engine

        self.spec = spec if isinstance(spec, InstanceSpec) else InstanceSpec.from_bytes(spec)
        spec = self.spec
        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        self._clock = clock
        if spec.model is None:
            from worker.default_model import build_default_model

            model, tokenizer, generation = build_default_model(dtype=spec.dtype, device=spec.device)
        else:
            from worker.loader import load_model

            model, tokenizer, generation = load_model(spec.model, dtype=spec.dtype, device=spec.device)
        self.faults = FaultInjector.from_mapping(spec.faults) if spec.faults else None
        self._wake = threading.Event()
        self.engine = Engine(
            model,
            tokenizer,
            spec.engine,
            generation_config=generation,
            clock=clock,
            hold_hook=self.faults.hold_seconds if self.faults is not None and self.faults.enabled else None,
            instance_id=spec.instance_id,
            on_inbox=self._wake.set,
        )
        self.incarnation = uuid.uuid4().hex
        security = TransportSecurity(token=spec.cluster_token)
        role = spec.role
        self.receiver = None
        self.sender = None
        transfer_address = ""
        if role in (InstanceRole.GENERATION, InstanceRole.MIXED):
            from worker.kv_transfer.receiver import KvTransferServer

            self.receiver = KvTransferServer(
                _EngineSink(self.engine),
                ReceiverConfig.from_mapping({**(spec.receiver or {}), "host": _bind_host(spec.transfer_host), "port": spec.transfer_port}),
                security=security,
                faults=self.faults,
            )
            self.receiver.start()
            transfer_address = self.receiver.address
        if role in (InstanceRole.PREFILL, InstanceRole.MIXED):
            from worker.kv_transfer.sender import KvSender

            self.sender = KvSender(SenderConfig.from_mapping(spec.sender or {}), security=security, faults=self.faults)
        self._push_pool = concurrent.futures.ThreadPoolExecutor(max_workers=spec.push_threads, thread_name_prefix="kv-push")
        self.info = InstanceInfo(
            instance_id=spec.instance_id,
            role=role,
            incarnation=self.incarnation,
            transfer_address=transfer_address,
            layout=self.engine.layout,
            num_blocks=self.engine.blocks.num_blocks,
            vocab_size=self.engine.vocab_size,
            max_seq_len=self.engine.max_seq_len,
            pid=os.getpid(),
            device=str(model.device),
            node_id=_node_id(),
        )
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._mailbox = threading.Condition()
        self._outputs: list = []
        self._events: list = []
        self._reservations: list = []
        self._pushes: list = []
        self._rejected: list = []
        self._sequence = 0
        self._stopping = False
        self._draining = False
        self._loop_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"engine-{spec.instance_id}", daemon=True)
        self._thread.start()
        logger.info("instance %s (%s) ready, transfer address %r", spec.instance_id, role.name, transfer_address)

    # --- calls from the router (any thread) ---------------------------------------------------------
    def get_info(self) -> bytes:
        return encode_info(self.info)

    def ping(self) -> str:
        """Cheap liveness probe: the incarnation (changes when the process restarts)."""
        if self._loop_error is not None:
            raise InstanceError(f"engine loop died: {self._loop_error}")
        return self.incarnation

    def submit(self, payload: bytes) -> None:
        """Queue a request; raises EngineInputError / InvalidSamplingParams (naming the field) if
        the engine refuses it."""
        if self._stopping or self._draining:
            raise InstanceError(f"instance {self.spec.instance_id} is not accepting requests (draining)")
        submit = decode_submit(payload)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("submit", submit, done))
        error = done.result(timeout=SUBMIT_TIMEOUT_S)
        if error is not None:
            raise error

    def abort(self, request_id: str, detail: str = "aborted") -> None:
        self._command(("abort", request_id, detail))

    def push(
        self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str | None = None
    ) -> None:
        """Start pushing a CONTEXT_ONLY request's KV to a generation instance's reservation.
        `target_request_id` is the request's id on the receiver (default: the same id)."""
        self._command(("push", request_id, target, transfer_id, float(deadline_s), target_request_id or request_id))

    def release(self, request_id: str, reason: str, detail: str = "") -> None:
        """Give up a CONTEXT_ONLY request's hand-over: DISAGG_TRANS_ERROR, blocks freed."""
        self._command(("release", request_id, FailureReason(reason), detail))

    def poll(self, timeout_s: float) -> bytes:
        """Everything reported since the last poll; waits up to timeout_s for something to report."""
        deadline = time.monotonic() + max(0.0, min(float(timeout_s), 60.0))
        with self._mailbox:
            while not self._has_mail() and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._mailbox.wait(remaining)
            outputs, self._outputs = self._outputs, []
            events, self._events = self._events, []
            reservations, self._reservations = self._reservations, []
            pushes, self._pushes = self._pushes, []
            rejected, self._rejected = self._rejected, []
            self._sequence += 1
            sequence = self._sequence
        if self._loop_error is not None:
            raise InstanceError(f"engine loop died: {self._loop_error}")
        load_box: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("load", load_box))
        try:
            load = load_box.result(timeout=5.0)
        except concurrent.futures.TimeoutError:
            load = None
        return encode_poll(
            PollBatch(
                incarnation=self.incarnation,
                sequence=sequence,
                outputs=tuple(outputs),
                events=tuple(events),
                reservations=tuple(reservations),
                push_results=tuple(pushes),
                load=load,
                rejected=tuple(rejected),
            )
        )

    def kv_digest(self, request_id: str, num_tokens: int) -> str:
        """sha256 of the request's KV for token positions [0, num_tokens), every layer (for tests and
        audits: compare what a sender had with what a receiver got)."""
        box: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("digest", request_id, num_tokens, box))
        return box.result(timeout=30.0)

    def drain(self, timeout_s: float = 60.0) -> int:
        """Stop taking requests, let the admitted ones finish; returns how many were left unfinished."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            box: concurrent.futures.Future = concurrent.futures.Future()
            self._command(("count", box))
            if box.result(timeout=10.0) == 0:
                return 0
            time.sleep(0.05)
        box = concurrent.futures.Future()
        self._command(("count", box))
        return box.result(timeout=10.0)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        with self._mailbox:
            self._mailbox.notify_all()
        self._thread.join(timeout=10.0)
        self._push_pool.shutdown(wait=False, cancel_futures=True)
        if self.receiver is not None:
            self.receiver.stop()
        if self.sender is not None:
            self.sender.close()

    # --- the loop thread ------------------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        if self._stopping:
            raise InstanceError(f"instance {self.spec.instance_id} is stopped")
        self._commands.put(command)
        self._wake.set()

    def _has_mail(self) -> bool:
        return bool(self._outputs or self._events or self._reservations or self._pushes or self._rejected)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                worked = False
                if self.engine.has_work():
                    before = self.engine.num_forward_tokens
                    outputs = self.engine.step()
                    worked = bool(outputs) or self.engine.num_forward_tokens != before
                    self._publish(outputs)
                if not worked:
                    # Nothing runnable: sleep until a command or an inbox item arrives (bounded,
                    # so timers such as leases and reservations are still checked).
                    self._wake.wait(0.02)
                    self._wake.clear()
        except Exception as error:  # noqa: BLE001 - reported to the router, which fails the requests
            logger.exception("engine loop of %s died", self.spec.instance_id)
            self._loop_error = f"{type(error).__name__}: {error}"
            with self._mailbox:
                self._mailbox.notify_all()

    def _publish(self, outputs: list) -> None:
        events = self.engine.drain_events()
        reservations = [
            ReservationNotice(r.request_id, r.transfer_id, r.num_blocks, r.expires_at_s)
            for r in self.engine.drain_new_reservations()
        ]
        if not (outputs or events or reservations):
            return
        with self._mailbox:
            self._outputs.extend(outputs)
            self._events.extend(events)
            self._reservations.extend(reservations)
            self._mailbox.notify_all()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "submit":
                _, submit, done = command
                try:
                    self.engine.add_request(submit)
                except (EngineInputError, InvalidSamplingParams) as error:
                    done.set_result(error)
                else:
                    done.set_result(None)
            elif kind == "abort":
                self.engine.abort(command[1], command[2])
            elif kind == "push":
                self._start_push(*command[1:])
            elif kind == "release":
                _, request_id, reason, detail = command
                self.engine.release(request_id, TransferFailure(reason, detail))
            elif kind == "load":
                command[1].set_result(self.engine.load())
            elif kind == "count":
                command[1].set_result(self.engine.num_requests)
            elif kind == "digest":
                _, request_id, num_tokens, box = command
                try:
                    box.set_result(self.engine.kv_digest(request_id, num_tokens))
                except Exception as error:  # noqa: BLE001 - handed back to the caller
                    box.set_exception(error)
            self._publish([])

    def _start_push(self, request_id: str, target: str, transfer_id: str, deadline_s: float, target_request_id: str) -> None:
        from worker.engine import EngineError

        if self.sender is None:
            self._report_push(PushResult(request_id, transfer_id, False, FailureReason.INTERNAL.value, "this instance sends no KV", 0, 0.0))
            return
        try:
            source = self.engine.begin_push(request_id)
        except EngineError as error:
            self._report_push(PushResult(request_id, transfer_id, False, FailureReason.UNKNOWN_TRANSFER.value, str(error), 0, 0.0))
            return

        def run() -> None:
            try:
                outcome = self.sender.push(target, transfer_id, target_request_id, source, deadline_s)
                failure = outcome.failure
                result = PushResult(
                    request_id, transfer_id, outcome.ok, None if failure is None else failure.reason.value,
                    "" if failure is None else failure.detail, outcome.bytes_sent, outcome.elapsed_s,
                )
            except Exception as error:  # noqa: BLE001 - a push must always report back
                failure = TransferFailure(FailureReason.INTERNAL, f"{type(error).__name__}: {error}")
                result = PushResult(request_id, transfer_id, False, failure.reason.value, failure.detail, 0, 0.0)
            self.engine.report_push(request_id, failure)
            self._report_push(result)

        self._push_pool.submit(run)

    def _report_push(self, result: PushResult) -> None:
        with self._mailbox:
            self._pushes.append(result)
            self._mailbox.notify_all()
