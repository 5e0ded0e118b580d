"""An in-memory TransferSink, and a receiver that runs it in a process of its own.

For tests, benches and smoke checks of the transport (and of a deployment's network path): the
sink reserves room for transfers announced with `expect`, stores what arrives into a
LinearKvBuffer, and records every call the transport makes on each target. `ReceiverProcess`
spawns a KvTransferServer with such a sink and is driven over a local pipe with JSON commands
(no pickle anywhere). It also starts the baselines bench/transfer_bench.py measures the transport
against, in the same process: a raw TCP sink and a bare gRPC sink.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from worker.kv_layout import KvLayout
from worker.kv_transfer.buffers import LinearKvBuffer
from worker.kv_transfer.config import ReceiverConfig, TransportSecurity, grpc_options
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected
from worker.kv_transfer.faults import FaultInjector
from worker.kv_transfer.malloc_tuning import tune_malloc_for_transfers
from worker.kv_transfer.tls import TlsConfig


class MemoryTarget:
    """A TransferTarget over a LinearKvBuffer that records what the transport did to it."""

    def __init__(
        self, layout: KvLayout, num_blocks: int, on_end: threading.Condition, storage: bytearray | None = None
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.storage = storage if storage is not None else bytearray(layout.run_bytes(layout.num_layers, num_blocks))
        self.buffer = LinearKvBuffer(layout, num_blocks, self.storage)
        self._lock = threading.Lock()
        self._on_end = on_end
        self.events: list[str] = []
        self.state = "OPEN"
        self.failure: TransferFailure | None = None
        self.writes = 0
        self.concurrent_writes = 0
        self.max_concurrent_writes = 0

    def write(self, layer_start: int, layer_end: int, block_start: int, block_end: int, data: memoryview) -> None:
        with self._lock:
            if self.state != "OPEN":
                # The transport promises no write after commit or fail; record the breach loudly.
                self.events.append(f"write-after-{self.state.lower()}")
            self.concurrent_writes += 1
            self.max_concurrent_writes = max(self.max_concurrent_writes, self.concurrent_writes)
        try:
            self.buffer.write(layer_start, layer_end, block_start, block_end, data)
        finally:
            with self._lock:
                self.concurrent_writes -= 1
                self.writes += 1

    def fill(self, layer_start: int, layer_end: int, block_start: int, block_end: int, copy) -> bool:
        """The storage of the range, filled by `copy` (TransferViewsTarget): what the shared-memory plane does."""
        with self._lock:
            if self.state != "OPEN":
                self.events.append(f"write-after-{self.state.lower()}")
            self.concurrent_writes += 1
            self.max_concurrent_writes = max(self.max_concurrent_writes, self.concurrent_writes)
        try:
            copy(self.buffer.read_parts(layer_start, layer_end, block_start, block_end))
        finally:
            with self._lock:
                self.concurrent_writes -= 1
                self.writes += 1
        return True

    def commit(self, token_ids: tuple[int, ...] = ()) -> None:
        with self._on_end:
            with self._lock:
                self.events.append("commit")
                self.state = "COMMITTED"
            self._on_end.notify_all()

    def fail(self, failure: TransferFailure) -> None:
        with self._on_end:
            with self._lock:
                self.events.append(f"fail:{failure.reason.value}")
                if self.concurrent_writes:
                    self.events.append("fail-during-write")
                self.state = "FAILED"
                self.failure = failure
            self._on_end.notify_all()


@dataclass(frozen=True)
class ReceivedTransfer:
    """What a MemorySink knows about one transfer."""

    transfer_id: str
    state: str  # UNOPENED, OPEN, COMMITTED or FAILED
    failure_reason: str | None
    failure_detail: str
    events: tuple[str, ...]
    writes: int
    crc32: int | None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ReceivedTransfer:
        return cls(**{**data, "events": tuple(data["events"])})


class MemorySink:
    """A TransferSink whose reservations are made by `expect` (as an engine's scheduler would)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = threading.Condition()
        self._expected: dict[str, tuple[str, KvLayout, int]] = {}
        self._targets: dict[str, MemoryTarget] = {}
        # Storage of released targets, by size: reused like an engine's preallocated cache.
        self._spare: dict[int, list[bytearray]] = {}

    def expect(self, transfer_id: str, request_id: str, layout: KvLayout, num_blocks: int) -> None:
        with self._lock:
            self._expected[transfer_id] = (request_id, layout, num_blocks)

    def open(self, transfer_id: str, request_id: str, peer_layout: KvLayout) -> MemoryTarget:
        with self._lock:
            expected = self._expected.pop(transfer_id, None)
            if expected is None or expected[0] != request_id:
                if expected is not None:
                    self._expected[transfer_id] = expected
                raise TransferRejected(FailureReason.UNKNOWN_TRANSFER, "no reservation under this transfer id")
            _, layout, num_blocks = expected
            spare = self._spare.get(layout.run_bytes(layout.num_layers, num_blocks))
            target = MemoryTarget(layout, num_blocks, self._ended, spare.pop() if spare else None)
            self._targets[transfer_id] = target
            return target

    def target(self, transfer_id: str) -> MemoryTarget | None:
        with self._lock:
            return self._targets.get(transfer_id)

    def result(self, transfer_id: str, wait_s: float = 0.0) -> ReceivedTransfer:
        """The transfer's state, waiting up to wait_s for it to end (commit or fail)."""
        deadline = time.monotonic() + wait_s
        with self._ended:
            while True:
                target = self.target(transfer_id)
                if target is not None and target.state != "OPEN":
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._ended.wait(remaining)
        if target is None:
            return ReceivedTransfer(transfer_id, "UNOPENED", None, "", (), 0, None)
        with target._lock:
            failure = target.failure
            return ReceivedTransfer(
                transfer_id=transfer_id,
                state=target.state,
                failure_reason=failure.reason.value if failure else None,
                failure_detail=failure.detail if failure else "",
                events=tuple(target.events),
                writes=target.writes,
                crc32=zlib.crc32(target.buffer.view),
            )

    def release(self, transfer_id: str) -> None:
        """Forget a transfer; its storage is reused (not cleared) by a later one of the same size."""
        with self._lock:
            target = self._targets.pop(transfer_id, None)
            if target is not None:
                self._spare.setdefault(target.buffer.size_bytes, []).append(target.storage)

    def data(self, transfer_id: str) -> bytes:
        target = self.target(transfer_id)
        return bytes(target.buffer.view) if target is not None else b""


# -- a receiver in its own process --------------------------------------------------------------


def _layout_to_dict(layout: KvLayout) -> dict[str, Any]:
    return asdict(layout)


def _tls_to_dict(tls: TlsConfig | None) -> dict[str, Any] | None:
    if tls is None:
        return None
    return {
        "certificate_chain_pem": tls.certificate_chain_pem.decode("ascii"),
        "private_key_pem": tls.private_key_pem.decode("ascii"),
        "root_certificates_pem": tls.root_certificates_pem.decode("ascii"),
        "require_client_auth": tls.require_client_auth,
        "server_name_override": tls.server_name_override,
    }


def _tls_from_dict(data: Mapping[str, Any] | None) -> TlsConfig | None:
    if data is None:
        return None
    return TlsConfig(
        certificate_chain_pem=data["certificate_chain_pem"].encode("ascii"),
        private_key_pem=data["private_key_pem"].encode("ascii"),
        root_certificates_pem=data["root_certificates_pem"].encode("ascii"),
        require_client_auth=data["require_client_auth"],
        server_name_override=data["server_name_override"],
    )


def _serve(connection: Connection, settings_json: str) -> None:
    """The receiver process: serve until told to stop or the parent goes away."""
    import logging

    settings = json.loads(settings_json)
    logging.basicConfig(level=settings.get("log_level", "WARNING"))
    if settings["tune_malloc"]:
        tune_malloc_for_transfers()  # before gRPC starts its threads
    from worker.kv_transfer.receiver import KvTransferServer

    sink = MemorySink()
    security = TransportSecurity(token=settings["token"], tls=_tls_from_dict(settings["tls"]))
    faults = FaultInjector.from_mapping(settings["faults"]) if settings["faults"] else None
    server = KvTransferServer(sink, ReceiverConfig.from_mapping(settings["config"]), security=security, faults=faults)
    port = server.start()
    connection.send_bytes(json.dumps({"port": port}).encode())
    bare_servers: list[Any] = []
    try:
        while True:
            try:
                command = json.loads(connection.recv_bytes())
            except EOFError:
                return
            op = command["op"]
            if op == "stop":
                connection.send_bytes(b"{}")
                return
            if op == "expect":
                sink.expect(command["transfer_id"], command["request_id"], KvLayout(**command["layout"]), command["num_blocks"])
                connection.send_bytes(b"{}")
            elif op == "result":
                result = sink.result(command["transfer_id"], command["wait_s"])
                connection.send_bytes(json.dumps(asdict(result)).encode())
                if command.get("with_data"):
                    connection.send_bytes(sink.data(command["transfer_id"]))
            elif op == "release":
                sink.release(command["transfer_id"])
                connection.send_bytes(b"{}")
            elif op == "raw_tcp_sink":
                port = _start_raw_tcp_sink(command["max_bytes"])
                connection.send_bytes(json.dumps({"port": port}).encode())
            elif op == "bare_grpc_sink":
                bare_server, port = _start_bare_grpc_sink(command["max_bytes"], command["max_message_bytes"])
                bare_servers.append(bare_server)
                connection.send_bytes(json.dumps({"port": port}).encode())
            elif op == "stats":
                connection.send_bytes(json.dumps(asdict(server.stats())).encode())
            else:
                connection.send_bytes(json.dumps({"error": f"unknown op {op!r}"}).encode())
    finally:
        server.stop(grace_s=0.5)
        for bare_server in bare_servers:
            bare_server.stop(0)


BARE_GRPC_SERVICE = "duet.bench.BareSink"
BARE_GRPC_METHOD = f"/{BARE_GRPC_SERVICE}/Push"


def _start_bare_grpc_sink(max_bytes: int, max_message_bytes: int) -> tuple[Any, int]:
    """A gRPC server with one client-streaming method that copies every message into one preallocated
    buffer (wrapping around) and answers with nothing: what any gRPC Python receiver must do at the
    least, with the transport's channel options but no framing, checks or checksums. Its bandwidth is
    the ceiling of a gRPC-based data path between these processes. It copies as the transport does,
    with the GIL released (numpy), so that parallel streams copy in parallel."""
    buffer = np.zeros(max_bytes, dtype=np.uint8)

    def push(request_iterator: Any, context: Any) -> bytes:
        offset = 0
        for message in request_iterator:
            size = len(message)
            if size > max_bytes:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "message larger than the sink")
            if offset + size > max_bytes:
                offset = 0
            np.copyto(buffer[offset : offset + size], np.frombuffer(message, dtype=np.uint8))
            offset += size
        return b""

    server = grpc.server(
        ThreadPoolExecutor(max_workers=16, thread_name_prefix="bare-sink"),
        handlers=[grpc.method_handlers_generic_handler(BARE_GRPC_SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(push)})],
        options=grpc_options(max_message_bytes),
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _start_raw_tcp_sink(max_bytes: int) -> int:
    """A plain TCP receiver (the baseline for the transport's bandwidth): each message is an 8-byte
    length and that many bytes, received with recv_into into one preallocated buffer, answered with
    one byte once it has all arrived."""
    listener = socket.create_server(("127.0.0.1", 0))
    buffer = bytearray(max_bytes)
    view = memoryview(buffer)

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = connection.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                size = int.from_bytes(header, "little")
                if size > max_bytes:
                    return
                received = 0
                while received < size:
                    count = connection.recv_into(view[received:size])
                    if count == 0:
                        return
                    received += count
                connection.sendall(b"k")

    threading.Thread(target=serve, name="raw-tcp-sink", daemon=True).start()
    return listener.getsockname()[1]


class ReceiverProcessError(RuntimeError):
    """The receiver process did not start, died, or answered nonsense."""


class ReceiverProcess:
    """A KvTransferServer with a MemorySink in a spawned process, on 127.0.0.1 by default."""

    def __init__(
        self,
        *,
        config: Mapping[str, Any] | None = None,
        token: str | None = None,
        tls: TlsConfig | None = None,
        faults: Mapping[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        log_level: str = "WARNING",
        tune_malloc: bool = False,
    ) -> None:
        ReceiverConfig.from_mapping(dict(config or {}))  # fail here, not in the child
        TransportSecurity(token=token, tls=tls)
        FaultInjector.from_mapping(faults)
        self._settings = json.dumps(
            {
                "config": dict(config or {}),
                "token": token,
                "tls": _tls_to_dict(tls),
                "faults": dict(faults or {}),
                "log_level": log_level,
                "tune_malloc": tune_malloc,
            }
        )
        self._start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None
        self.port: int | None = None

    def start(self) -> str:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_serve, args=(child_end, self._settings), name="kv-receiver", daemon=True)
        process.start()
        child_end.close()
        self._process, self._connection = process, parent_end
        if not parent_end.poll(self._start_timeout_s):
            self.kill()
            raise ReceiverProcessError(f"receiver did not start within {self._start_timeout_s} s")
        try:
            self.port = json.loads(parent_end.recv_bytes())["port"]
        except EOFError:
            raise ReceiverProcessError(f"receiver process exited during start (exit code {process.exitcode})") from None
        return self.address

    @property
    def address(self) -> str:
        if self.port is None:
            raise ReceiverProcessError("not started")
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _call(self, command: Mapping[str, Any], *, with_data: bool = False, timeout_s: float = 60.0) -> tuple[Any, bytes | None]:
        with self._lock:
            if self._connection is None:
                raise ReceiverProcessError("not started")
            try:
                self._connection.send_bytes(json.dumps(command).encode())
                if not self._connection.poll(timeout_s):
                    raise ReceiverProcessError(f"no answer to {command['op']} within {timeout_s} s")
                answer = json.loads(self._connection.recv_bytes())
                data = self._connection.recv_bytes() if with_data else None
            except (EOFError, BrokenPipeError, ConnectionResetError) as error:
                raise ReceiverProcessError(f"receiver process is gone: {error!r}") from None
        if isinstance(answer, dict) and "error" in answer:
            raise ReceiverProcessError(answer["error"])
        return answer, data

    def expect(self, transfer_id: str, request_id: str, layout: KvLayout, num_blocks: int) -> None:
        """Reserve room for a transfer (what the generation engine does at DISAGG_GENERATION_INIT)."""
        self._call(
            {"op": "expect", "transfer_id": transfer_id, "request_id": request_id, "layout": _layout_to_dict(layout), "num_blocks": num_blocks}
        )

    def result(self, transfer_id: str, *, wait_s: float = 5.0) -> ReceivedTransfer:
        answer, _ = self._call({"op": "result", "transfer_id": transfer_id, "wait_s": wait_s}, timeout_s=wait_s + 30.0)
        return ReceivedTransfer.from_mapping(answer)

    def received_bytes(self, transfer_id: str, *, wait_s: float = 5.0) -> tuple[ReceivedTransfer, bytes]:
        answer, data = self._call(
            {"op": "result", "transfer_id": transfer_id, "wait_s": wait_s, "with_data": True}, with_data=True, timeout_s=wait_s + 30.0
        )
        assert data is not None
        return ReceivedTransfer.from_mapping(answer), data

    def release(self, transfer_id: str) -> None:
        """Let the receiver reuse a finished transfer's storage."""
        self._call({"op": "release", "transfer_id": transfer_id})

    def start_raw_tcp_sink(self, max_bytes: int) -> int:
        """Start a plain-TCP receiver in the same process (see _start_raw_tcp_sink); returns its port."""
        answer, _ = self._call({"op": "raw_tcp_sink", "max_bytes": max_bytes})
        return answer["port"]

    def start_bare_grpc_sink(self, max_bytes: int, max_message_bytes: int) -> int:
        """Start a bare gRPC receiver in the same process (see _start_bare_grpc_sink); returns its port.
        Its method is BARE_GRPC_METHOD; requests and the answer are raw bytes."""
        answer, _ = self._call({"op": "bare_grpc_sink", "max_bytes": max_bytes, "max_message_bytes": max_message_bytes})
        return answer["port"]

    def stats(self) -> dict[str, int]:
        answer, _ = self._call({"op": "stats"})
        return answer

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            try:
                self._call({"op": "stop"}, timeout_s=timeout_s)
            except ReceiverProcessError:
                pass  # already gone: joined or killed below
            self._process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(10.0)
        if self._connection is not None:
            self._connection.close()
        self._process, self._connection = None, None

    def __enter__(self) -> ReceiverProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
