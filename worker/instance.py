"""One serving instance as a process-level object: the engine, its step loop thread, its KV transfer
server (receiver) and sender, and a mailbox the router polls.

This is the facade a Ray actor wraps (cluster/deploy/launch.py does `ray.remote(Instance)`); it is a
plain class, so tests drive it in-process too. The router reaches it through one entry point,
`handle`: an encoded Command in, an encoded Reply out (worker/protocol.py). Nothing pickled crosses
it, and no actor method name is part of the protocol.

Threads: the loop thread owns the engine. Commands from the router arrive on other threads; those
that touch the engine become typed loop commands that the loop runs between steps, and a Poll waits
on the mailbox. Pushes run on a small thread pool and report back through the engine's hand-over
inbox.
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

import msgspec

from scheduler.state import LlmRequestState
from worker.engine_types import EngineConfig
from worker.kv_transfer.config import ReceiverConfig, SenderConfig, TransferConfigError, TransportSecurity
from worker.kv_transfer.failures import FailureReason, TransferFailure
from worker.kv_transfer.faults import FaultInjector
from worker.kv_transfer.tls import TlsConfig, TlsConfigError
from worker.protocol import (
    Abort,
    Ack,
    Command,
    Decoder,
    Digest,
    Drain,
    Drained,
    Encoder,
    EngineInputError,
    GetInfo,
    InstanceInfo,
    InstanceRole,
    KvDigest,
    Ping,
    Poll,
    PollBatch,
    Pong,
    ProtocolError,
    Push,
    PushResult,
    Rejected,
    Release,
    Renew,
    ReplaceTransferTls,
    Reply,
    ReservationNotice,
    Submit,
    SubmitRequest,
    Unavailable,
)
from worker.sampling import InvalidSamplingParams
from worker.stream_merge import StreamMerger

logger = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 30.0
# InstanceSpec.model "builtin:bench": the engine benchmark's built-in model (worker/default_model.py).
BUILTIN_PREFIX = "builtin:"

# What a step's planning can record that nobody waits for before the step's own tokens: a
# hand-over that landed (its commit, applied as the step began, and the decode step taking it up).
# Published before the forward pass, they answered the router's poll in the middle of the decode
# step that the request's second token waits for, and the answer and the router's next poll ran
# beside that step; they now go out with its token. (Prefill started and reservations still go out
# before the pass: an early reservation and its relay wait for them.)
_AFTER_THE_STEP = frozenset({LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE, LlmRequestState.GENERATION_IN_PROGRESS})


class InstanceError(RuntimeError):
    """The instance cannot do what was asked (stopped, draining, bad spec)."""


@dataclass(frozen=True)
class InstanceSpec:
    """How to build one instance (plain data: it travels to the actor in worker/protocol.py's codec)."""

    instance_id: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    device: str = "auto"
    transfer_host: str = "127.0.0.1"  # "auto": this node's Ray address (loopback outside Ray)
    transfer_port: int = 0
    cluster_token: str | None = None
    # Mutual TLS of the KV transfer path (this instance's key and certificate, the deployment's CA),
    # handed over as the token is; None: plain TCP (one node, or `kv_transfer.tls: off`).
    transfer_tls: TlsConfig | None = None
    torch_threads: int | None = None
    faults: Mapping[str, Any] | None = None
    # Pushes at once. A push mostly waits (on its streams, and a streaming one on its context's
    # chunks), and one stuck behind others is a stalled hand-over: keep this well above the
    # prefills an instance runs at once.
    push_threads: int = 16
    sender: Mapping[str, Any] | None = None  # SenderConfig fields
    receiver: Mapping[str, Any] | None = None  # ReceiverConfig fields (host/port come from above)
    shm_tag: str = "0"  # this cluster's tag in shared-memory segment names (worker/kv_transfer/shm.py)
    # A file the loop appends one JSON line per engine step to: what the step ran and how long it
    # took, as the instance ran it (worker/profiler.py StepLog; `duet profile --deployed` fits
    # these). None: off.
    step_log: str | None = None

    @property
    def role(self) -> InstanceRole:
        return self.engine.role

    def to_bytes(self) -> bytes:
        return Encoder().encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> InstanceSpec:
        return Decoder(InstanceSpec).decode(data)


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


# --- what the loop thread runs: typed commands, dispatched by type -----------------------------------
# Abort, Push and Release (worker/protocol.py) go to the loop as they came; the rest carry a future.
@dataclass(frozen=True)
class _Admit:
    request: SubmitRequest
    done: concurrent.futures.Future  # None, or the EngineInputError / InvalidSamplingParams refusing it


@dataclass(frozen=True)
class _CountRequests:
    box: concurrent.futures.Future


@dataclass(frozen=True)
class _ReadDigest:
    request_id: str
    num_tokens: int
    box: concurrent.futures.Future


_LoopCommand = _Admit | Abort | Push | Renew | Release | _CountRequests | _ReadDigest


def _refused_input(error: BaseException) -> EngineInputError | InvalidSamplingParams | None:
    """The field check behind a decoding error (msgspec chains a __post_init__ error as the cause)."""
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, (EngineInputError, InvalidSamplingParams)):
            return cause
        cause = cause.__cause__
    return None


class Instance:
    def __init__(self, spec: bytes | InstanceSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        from worker.engine import Engine

        self.spec = spec if isinstance(spec, InstanceSpec) else InstanceSpec.from_bytes(spec)
        spec = self.spec
        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        self._clock = clock
        if spec.model is None or spec.model.startswith(BUILTIN_PREFIX):
            from worker.default_model import build_default_model

            variant = "default" if spec.model is None else spec.model[len(BUILTIN_PREFIX) :]
            model, tokenizer, generation = build_default_model(dtype=spec.dtype, device=spec.device, variant=variant)
        else:
            from worker.loader import load_model

            model, tokenizer, generation = load_model(spec.model, dtype=spec.dtype, device=spec.device)
        self.faults = FaultInjector.from_mapping(spec.faults) if spec.faults else None
        self._wake = threading.Event()
        self._step_log = None
        runner_factory = {}
        if spec.step_log is not None:
            from worker.profiler import StepLog

            self._step_log = StepLog(spec.step_log)
            runner_factory = {"runner_factory": self._step_log.runner_factory}
        self.engine = Engine(
            model,
            tokenizer,
            spec.engine,
            generation_config=generation,
            clock=clock,
            hold_hook=self.faults.hold_seconds if self.faults is not None and self.faults.enabled else None,
            instance_id=spec.instance_id,
            on_inbox=self._wake.set,
            before_forward=self._publish_planned,
            **runner_factory,
        )
        self.incarnation = uuid.uuid4().hex
        security = TransportSecurity(token=spec.cluster_token, tls=spec.transfer_tls)
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

            self.sender = KvSender(
                SenderConfig.from_mapping(spec.sender or {}), security=security, faults=self.faults, shm_tag=spec.shm_tag
            )
        self._push_pool = concurrent.futures.ThreadPoolExecutor(max_workers=spec.push_threads, thread_name_prefix="kv-push")
        # Pushes started and not yet returned: request id -> {transfer id: why it was cancelled, or
        # None}. A push nobody waits for any more is cancelled (`_cancel_pushes`) rather than left to
        # pin its request's blocks until its deadline. Loop thread and push threads: _push_lock.
        self._pushes_in_flight: dict[str, dict[str, str | None]] = {}
        self._push_lock = threading.Lock()
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
            architecture=model.config.architecture,
        )
        self._encoder = Encoder()
        self._decoder: Decoder[Command] = Decoder(Command)
        self._commands: queue.SimpleQueue[_LoopCommand] = queue.SimpleQueue()
        self._mailbox = threading.Condition()
        self._outputs: list = []
        self._events: list = []
        self._deferred_events: list = []  # planned events held for the step's outputs (_AFTER_THE_STEP)
        self._reservations: list = []
        self._pushes: list = []
        self._load = None  # the engine's load as of the loop's last step or command (EngineLoad)
        self._prefix_events: list = []
        self._merger = StreamMerger(spec.engine.stream_interval_ms / 1e3)  # under the mailbox lock
        self._sequence = 0
        self._stopping = False
        self._draining = False
        self._loop_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"engine-{spec.instance_id}", daemon=True)
        self._thread.start()
        logger.info("instance %s (%s) ready, transfer address %r", spec.instance_id, role.name, transfer_address)

    # --- calls from the router (any thread) ---------------------------------------------------------
    def handle(self, payload: bytes) -> bytes:
        """The one entry point: an encoded Command in, an encoded Reply out. A payload that does not
        decode raises ProtocolError (another protocol version: ProtocolVersionMismatch), except a
        submit whose request fails its field checks, which is Rejected like any refused input."""
        try:
            command = self._decoder.decode(payload)
        except ProtocolError as error:
            refused = _refused_input(error)
            if refused is None:
                raise
            return self._encoder.encode(Rejected(refused.field, refused.message))
        return self._encoder.encode(self._reply(command))

    def _reply(self, command: Command) -> Reply:
        try:
            match command:
                case Submit():
                    self._submit(command.request)
                    return Ack()
                case Abort() | Push() | Renew() | Release():
                    self._command(command)
                    return Ack()
                case Poll():
                    return self._poll(command.timeout_s)
                case GetInfo():
                    return self.info
                case Ping():
                    return Pong(self._ping())
                case Drain():
                    return Drained(self._drain(command.timeout_s))
                case KvDigest():
                    return Digest(self._kv_digest(command.request_id, command.num_tokens))
                case ReplaceTransferTls():
                    self._replace_transfer_tls(command.tls)
                    return Ack()
        except (EngineInputError, InvalidSamplingParams) as error:
            return Rejected(error.field, error.message)
        except InstanceError as error:
            return Unavailable(str(error))
        raise ProtocolError(f"no handler for {type(command).__name__}")

    def _ping(self) -> str:
        """Cheap liveness probe: the incarnation (changes when the process restarts)."""
        if self._loop_error is not None:
            raise InstanceError(f"engine loop died: {self._loop_error}")
        return self.incarnation

    def _submit(self, request: SubmitRequest) -> None:
        """Queue a request; raises EngineInputError / InvalidSamplingParams (naming the field) if
        the engine refuses it."""
        if self._stopping or self._draining:
            raise InstanceError(f"instance {self.spec.instance_id} is not accepting requests (draining)")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._command(_Admit(request, done))
        error = done.result(timeout=SUBMIT_TIMEOUT_S)
        if error is not None:
            raise error

    def _poll(self, timeout_s: float) -> PollBatch:
        """Everything reported since the last poll; waits up to timeout_s for something to report."""
        deadline = time.monotonic() + max(0.0, min(float(timeout_s), 60.0))
        with self._mailbox:
            while True:
                now = time.monotonic()
                if self._merger.num_held:
                    self._outputs.extend(self._merger.take_due(now))
                remaining = deadline - now
                if self._has_mail() or self._stopping or remaining <= 0:
                    break
                due_s = self._merger.next_due_s()
                # Held tokens wake the poll when due (not before: a short wait would spin).
                self._mailbox.wait(remaining if due_s is None else min(remaining, max(due_s - now, 0.001)))
            outputs, self._outputs = self._outputs, []
            events, self._events = self._events, []
            reservations, self._reservations = self._reservations, []
            pushes, self._pushes = self._pushes, []
            self._sequence += 1
            sequence = self._sequence
            load = self._take_load()
        if self._loop_error is not None:
            raise InstanceError(f"engine loop died: {self._loop_error}")
        return PollBatch(
            incarnation=self.incarnation,
            sequence=sequence,
            outputs=tuple(outputs),
            events=tuple(events),
            reservations=tuple(reservations),
            push_results=tuple(pushes),
            load=load,
        )

    def _replace_transfer_tls(self, tls: TlsConfig) -> None:
        """A certificate reissued for this process (the deployer's CA issues one when the instance
        restarts: Ray restarts the actor from its original spec, so it came back with its
        predecessor's). Connections made from now on, both ways, use it."""
        if self.spec.transfer_tls is None:
            raise EngineInputError("tls", "this instance's KV transfers are plain TCP: it has no certificate to replace")
        try:
            for side in (self.receiver, self.sender):
                if side is not None:
                    side.replace_tls(tls)
        except (TransferConfigError, TlsConfigError) as error:
            raise EngineInputError("tls", str(error)) from None
        logger.info("instance %s: KV transfer certificate replaced", self.spec.instance_id)

    def _kv_digest(self, request_id: str, num_tokens: int) -> str:
        """sha256 of the request's KV for token positions [0, num_tokens), every layer (for tests and
        audits: compare what a sender had with what a receiver got)."""
        box: concurrent.futures.Future = concurrent.futures.Future()
        self._command(_ReadDigest(request_id, num_tokens, box))
        return box.result(timeout=30.0)

    def _drain(self, timeout_s: float = 60.0) -> int:
        """Stop taking requests, let the admitted ones finish; returns how many were left unfinished."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            box: concurrent.futures.Future = concurrent.futures.Future()
            self._command(_CountRequests(box))
            if box.result(timeout=10.0) == 0:
                return 0
            time.sleep(0.05)
        box = concurrent.futures.Future()
        self._command(_CountRequests(box))
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
        if self._step_log is not None:
            self._step_log.close()

    # --- the loop thread ------------------------------------------------------------------------------
    def _command(self, command: _LoopCommand) -> None:
        if self._stopping:
            raise InstanceError(f"instance {self.spec.instance_id} is stopped")
        self._commands.put(command)
        self._wake.set()

    def _refresh_load(self) -> None:
        """Loop thread: snapshot the engine's load for the next poll. A poll never waits for the
        loop (a forward pass can take a while, and a poll must answer while it runs); the block
        manager's prefix events accumulate here until a poll takes them."""
        load = self.engine.load()
        with self._mailbox:
            self._prefix_events.extend(load.prefix_events)
            self._load = load

    def _take_load(self):
        """Under the mailbox lock: the latest load with every prefix event since the last poll."""
        if self._load is None:
            return None
        load = msgspec.structs.replace(self._load, prefix_events=tuple(self._prefix_events))
        self._prefix_events = []
        return load

    def _has_mail(self) -> bool:
        return bool(self._outputs or self._events or self._reservations or self._pushes)

    def _loop(self) -> None:
        try:
            self._refresh_load()
            while not self._stopping:
                self._run_commands()
                worked = False
                if self.engine.has_work():
                    before = self.engine.num_forward_tokens
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    stepped = time.perf_counter()
                    worked = bool(outputs) or self.engine.num_forward_tokens != before
                    # Outputs first, so that the router hears of a context's first token before any
                    # result of the push it started; the push right after (microseconds later).
                    self._refresh_load()
                    self._publish(outputs)
                    for push, source in self.engine.drain_ready_pushes():
                        self._start_push(push, source)
                    if self.engine.publish_prefixes():  # after the tokens and pushes: off their path
                        self._refresh_load()  # the router's prefix index hears of them now
                    if self._step_log is not None:
                        self._step_log.record(stepped - started, time.perf_counter() - started)
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

    def _publish_planned(self) -> None:
        """Loop thread, before a forward pass: what the step's planning recorded (prefill started,
        reservations) goes out now rather than after the pass, unless it is only a landed hand-over's
        events (_AFTER_THE_STEP), which wait for the pass's outputs. (The load snapshot is the previous
        step's until this one ends: refreshing it here too would walk every request twice a step.)"""
        self._publish([], planned=True)

    def _publish(self, outputs: list, *, planned: bool = False) -> None:
        events = self.engine.drain_events()
        if self._deferred_events:
            events, self._deferred_events = self._deferred_events + events, []
        reservations = [
            ReservationNotice(r.request_id, r.transfer_id, r.num_blocks, r.expires_at_s, r.lease_s)
            for r in self.engine.drain_new_reservations()
        ]
        if planned and events and not reservations and all(event.state in _AFTER_THE_STEP for event in events):
            self._deferred_events = events  # published after the pass, with its outputs
            return
        if not (outputs or events or reservations):
            return
        with self._mailbox:
            self._outputs.extend(self._merger.add(outputs, (event.request_id for event in events), time.monotonic()))
            self._events.extend(events)
            self._reservations.extend(reservations)
            self._mailbox.notify_all()

    def _run_commands(self) -> None:
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                if ran:
                    self._refresh_load()
                return
            ran = True
            match command:
                case _Admit():
                    try:
                        self.engine.add_request(command.request)
                    except (EngineInputError, InvalidSamplingParams) as error:
                        command.done.set_result(error)
                    else:
                        command.done.set_result(None)
                case Abort():
                    self._cancel_pushes(command.request_id, f"the request was aborted: {command.detail}")
                    self.engine.abort(command.request_id, command.detail)
                case Push():
                    # The router pushes a request again only once it gave the earlier push up (it
                    # stalled, and the transfer is retried to another receiver).
                    self._cancel_pushes(command.request_id, f"superseded by transfer {command.transfer_id}", keep=command.transfer_id)
                    if not self.engine.defer_push(command.request_id, command):
                        self._start_push(command)
                case Renew():
                    self.engine.renew(command.request_ids)
                case Release():
                    self._cancel_pushes(command.request_id, f"the hand-over was released: {command.detail}")
                    self.engine.release(command.request_id, TransferFailure(command.reason, command.detail))
                case _CountRequests():
                    command.box.set_result(self.engine.num_requests)
                case _ReadDigest():
                    try:
                        command.box.set_result(self.engine.kv_digest(command.request_id, command.num_tokens))
                    except Exception as error:  # noqa: BLE001 - handed back to the caller
                        command.box.set_exception(error)
            self._publish([])

    def _start_push(self, push: Push, source=None) -> None:
        """Start a push on the pool. `source`: a streaming source the engine pinned already (the
        push began on a context's finished chunks); None: the request's KV is final (begin_push)."""
        from worker.engine import EngineError

        request_id, target, transfer_id, deadline_s = push.request_id, push.target, push.transfer_id, push.deadline_s
        target_request_id = push.target_request_id or request_id

        if self.sender is None:
            self._report_push(PushResult(request_id, transfer_id, False, FailureReason.INTERNAL.value, "this instance sends no KV", 0, 0.0))
            return
        if source is None:
            try:
                source = self.engine.begin_push(request_id)
            except EngineError as error:
                self._report_push(PushResult(request_id, transfer_id, False, FailureReason.UNKNOWN_TRANSFER.value, str(error), 0, 0.0))
                return

        sender = self.sender
        with self._push_lock:
            self._pushes_in_flight.setdefault(request_id, {})[transfer_id] = None

        def cancelled() -> str | None:
            """Why `_cancel_pushes` cancelled this push, or None. It records the reason before it
            calls KvSender.cancel, so a cancel that comes before the sender can find the push is
            seen here (KvSender.push asks once it can)."""
            with self._push_lock:
                return self._pushes_in_flight.get(request_id, {}).get(transfer_id)

        def run() -> None:
            failure: TransferFailure | None
            try:
                outcome = sender.push(target, transfer_id, target_request_id, source, deadline_s, cancelled)
                failure = outcome.failure
                result = PushResult(
                    request_id, transfer_id, outcome.ok, None if failure is None else failure.reason.value,
                    "" if failure is None else failure.detail, outcome.bytes_sent, outcome.elapsed_s,
                )
            except Exception as error:  # noqa: BLE001 - a push must always report back
                failure = TransferFailure(FailureReason.INTERNAL, f"{type(error).__name__}: {error}")
                result = PushResult(request_id, transfer_id, False, failure.reason.value, failure.detail, 0, 0.0)
            finally:
                with self._push_lock:
                    mine = self._pushes_in_flight.get(request_id)
                    if mine is not None:
                        mine.pop(transfer_id, None)
                        if not mine:
                            del self._pushes_in_flight[request_id]
            self.engine.report_push(request_id, failure)
            self._report_push(result)

        self._push_pool.submit(run)

    def _cancel_pushes(self, request_id: str, detail: str, *, keep: str | None = None) -> None:
        """Loop thread: cancel the request's pushes in flight (but `keep`'s), which nobody waits for
        any more: each returns CANCELLED soon (KvSender.cancel) and unpins the blocks, instead of at
        its deadline (up to timeouts.transfer_s for a push relayed during the prefill)."""
        with self._push_lock:
            mine = self._pushes_in_flight.get(request_id)
            if not mine:
                return
            cancelled = [transfer_id for transfer_id, why in mine.items() if transfer_id != keep and why is None]
            for transfer_id in cancelled:
                mine[transfer_id] = detail
        for transfer_id in cancelled:
            if self.sender is not None:
                self.sender.cancel(transfer_id, detail)
            logger.info("cancelled the push of %s (transfer %s): %s", request_id, transfer_id, detail)

    def _report_push(self, result: PushResult) -> None:
        with self._mailbox:
            self._pushes.append(result)
            self._mailbox.notify_all()
