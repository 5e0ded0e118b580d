"""The sending end of KV transfers: pushes a request's KV from the prefill instance to the
generation instance's KvTransferServer.

One push: Prepare (both sides check compatibility before a byte moves), then the chunks over
`num_streams` parallel client streams spread over `num_connections` TCP connections, then Commit,
whose OK answer is the receiver's acknowledgement. `push` blocks, may be called from any thread,
and never raises for a transfer failure: it returns a TransferOutcome naming the FailureReason.

Data planes (SenderConfig.data_plane): on the gRPC plane the chunk messages carry the bytes. On the
shared-memory plane the push takes a pooled segment (worker/kv_transfer/shm.py), offers it at
Prepare with a random probe written into it, and, if the receiver read the probe back (it runs on
this host, as this user), writes each chunk into the segment and sends the same chunk messages with
an offset instead of the bytes. Everything else (streams, checksums, faults, Commit, Abort) is the
same on both planes; another plane (CUDA IPC, RDMA) would be one more way `PushRun._frames` places a
chunk's bytes and Prepare negotiates it.

This module is the sender: the connections it keeps to each receiver (worker/kv_transfer/connections.py),
its shared-memory pool, and the push API. One push's protocol is worker/kv_transfer/push.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from worker.kv_transfer.auth import bearer_metadata
from worker.kv_transfer.config import SenderConfig, TransferConfigError, TransportSecurity, grpc_options
from worker.kv_transfer.connections import Connections
from worker.kv_transfer.failures import FailureReason, TransferFailure
from worker.kv_transfer.faults import FaultInjector
from worker.kv_transfer.ids import check_request_id, check_transfer_id
from worker.kv_transfer.interfaces import TransferOutcome, TransferSource
from worker.kv_transfer.push import PushRun
from worker.kv_transfer.shm import SegmentPool, ShmError
from worker.kv_transfer.tls import TlsConfig

logger = logging.getLogger(__name__)

# Receivers remembered with open connections; the least recently used beyond this are closed.
MAX_CACHED_TARGETS = 64


class KvSender:
    """Pushes KV to receivers; keeps connections to each receiver open between pushes. Thread-safe."""

    def __init__(
        self,
        config: SenderConfig | None = None,
        *,
        security: TransportSecurity | None = None,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
        shm_tag: str = "0",
    ) -> None:
        """`shm_tag` names this cluster in shared-memory segment names, so that the launcher can sweep
        them when the cluster stops (worker/kv_transfer/shm.py)."""
        self._config = config or SenderConfig()
        self._security = security or TransportSecurity()
        self._faults = faults
        self._clock = clock
        self._metadata = bearer_metadata(self._security.token) if self._security.token is not None else ()
        self._lock = threading.Lock()
        self._connections: OrderedDict[str, Connections] = OrderedDict()
        # Connections made with a replaced certificate: pushes in flight may still use them, so
        # they are closed with the sender, not when the certificate is replaced.
        self._retired: list[Connections] = []
        self._closed = False
        self._shm_tag = shm_tag
        self._shm_pool: SegmentPool | None = None
        self._shm_problem: str | None = None  # why this sender has no pool (it is not retried)
        self._runs: dict[str, PushRun] = {}  # pushes in progress, by transfer id (`cancel`)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections.values()), OrderedDict()
            connections += self._retired
            self._retired = []
            pool = self._shm_pool
        for connection in connections:
            connection.close()
        if pool is not None:
            pool.close()

    def shm_pool(self) -> SegmentPool:
        """The shared-memory segment pool, created on first use; ShmError if there cannot be one."""
        with self._lock:
            if self._shm_pool is not None:
                return self._shm_pool
            if self._shm_problem is not None:
                raise ShmError(self._shm_problem)
            if self._closed:
                raise ShmError("KvSender is closed")
            config = self._config
            try:
                self._shm_pool = SegmentPool(
                    tag=self._shm_tag,
                    max_idle_bytes=config.shm_pool_bytes,
                    max_segment_bytes=config.shm_max_segment_bytes,
                    min_free_bytes=config.shm_min_free_bytes,
                )
            except (OSError, ValueError) as error:
                self._shm_problem = f"no shared-memory pool: {error}"
                raise ShmError(self._shm_problem) from error
            return self._shm_pool

    def replace_tls(self, tls: TlsConfig) -> None:
        """Present `tls` (a reissued certificate of the same CA) on every connection made from now
        on. The cached connections were made with the old one: later pushes open new ones, pushes in
        flight finish on theirs. Only a mutual-TLS sender has a certificate to replace."""
        with self._lock:
            if self._security.tls is None:
                raise TransferConfigError("this KV sender pushes over plain TCP: it has no certificate to replace")
            self._security = dataclasses.replace(self._security, tls=tls)
            self._retired.extend(self._connections.values())
            self._connections = OrderedDict()

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connect(self, target: str) -> Connections:
        with self._lock:
            if self._closed:
                raise RuntimeError("KvSender is closed")
            connections = self._connections.get(target)
            if connections is not None:
                self._connections.move_to_end(target)
                return connections
            options: list[tuple[str, Any]] = [
                *grpc_options(self._config.max_chunk_bytes),
                # A pool per channel gives each channel its own TCP connection.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            tls = self._security.tls
            channels = [
                grpc.secure_channel(target, tls.channel_credentials(), options + tls.channel_options())
                if tls is not None
                else grpc.insecure_channel(target, options)
                for _ in range(self._config.num_connections)
            ]
            connections = Connections(channels)
            self._connections[target] = connections
            evicted = []
            while len(self._connections) > MAX_CACHED_TARGETS:
                evicted.append(self._connections.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return connections

    def _forget(self, target: str, connections: Connections) -> None:
        """Drop `connections` from the cache if they are still the ones for `target` (found closed:
        the next push reconnects instead of failing on them too)."""
        with self._lock:
            if self._connections.get(target) is connections:
                del self._connections[target]

    def drop_connections(self, target: str) -> None:
        """Close the connections to `target` (the next push reconnects)."""
        with self._lock:
            connections = self._connections.pop(target, None)
        if connections is not None:
            connections.close()

    def cancel(self, transfer_id: str, detail: str) -> bool:
        """End the push of `transfer_id` now (any thread): it returns CANCELLED, telling the receiver
        why, as soon as it waits for its streams or its Prepare (a push whose source was final when it
        started makes its Prepare as a blocking call, and every push its Commit: those run to their
        own timeout first). False when no such push is in progress: a caller that may cancel a push
        about to start gives `push` its `cancelled` check, which closes that gap.

        For a push nobody waits for any more: its request was released or aborted, or the router
        retried the transfer elsewhere (it stalled). Until it returns it pins its request's blocks
        (worker/handover.py), up to its deadline."""
        with self._lock:
            run = self._runs.get(transfer_id)
        if run is None:
            return False
        run.cancel(TransferFailure(FailureReason.CANCELLED, detail))
        return True

    def push(
        self, target: str, transfer_id: str, request_id: str, source: TransferSource, deadline_s: float,
        cancelled: Callable[[], str | None] | None = None,
    ) -> TransferOutcome:
        """Push all of `source` to the receiver at `target` (host:port) under `transfer_id`; the whole
        push (prepare, chunks, commit) must finish within `deadline_s` seconds from now.

        `cancelled`, asked once the push can be cancelled (`cancel` finds it): why it was cancelled
        before then, or None. A caller that records a cancel before calling `cancel` thus loses none:
        either this check sees the record, or `cancel` comes after it and finds the push. A push
        cancelled before its Prepare returns CANCELLED without contacting the receiver.

        Raises ValueError only for invalid arguments (a caller's bug); every transfer failure is
        returned in the outcome."""
        check_transfer_id(transfer_id)
        check_request_id(request_id)
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not math.isfinite(deadline_s) or deadline_s <= 0:
            raise ValueError(f"deadline_s must be a positive finite number of seconds, got {deadline_s!r}")
        run = PushRun(self, target, transfer_id, request_id, source, self._clock() + deadline_s)
        started_s = self._clock()
        with self._lock:
            self._runs[transfer_id] = run
        try:
            why = None if cancelled is None else cancelled()
            if why is not None:
                run.cancel(TransferFailure(FailureReason.CANCELLED, why))
            failure = run.execute()
        finally:
            with self._lock:
                self._runs.pop(transfer_id, None)
        outcome = TransferOutcome(
            transfer_id=transfer_id,
            request_id=request_id,
            failure=failure,
            bytes_sent=run.bytes_sent,
            chunks_sent=run.chunks_sent,
            num_streams=run.num_streams,
            elapsed_s=self._clock() - started_s,
            data_plane=run.data_plane,
        )
        if failure is None:
            logger.debug(
                "pushed transfer %s: %d bytes in %.3f s over %s", transfer_id, outcome.bytes_sent, outcome.elapsed_s, run.data_plane
            )
        else:
            logger.warning("push of transfer %s (request %s) failed: %s", transfer_id, request_id, failure)
        return outcome
