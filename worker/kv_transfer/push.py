"""One KV push, on the sending side: its protocol, from Prepare to the receiver's acknowledgement.

`KvSender.push` (worker/kv_transfer/sender.py) runs a `PushRun` on the calling thread: Prepare (both
sides check compatibility before a byte moves; a push whose context still computes makes it as a call
a cancel can cut short), the chunks over the negotiated streams (their frames are produced in gRPC's
request-consumer threads, from a source final from the start or one whose blocks become final while
its context computes), then Commit (or the commit on the last chunk). Any failure, local (a cancel,
a fault, a source given up) or the receiver's, is told to the receiver (Abort) before the streams are
cancelled, and returned, never raised. On the shared-memory plane the chunks' bytes go through the
push's segment (worker/kv_transfer/push_segment.py) and the messages carry offsets.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayoutError
from worker.kv_transfer import codec
from worker.kv_transfer.connections import Connections
from worker.kv_transfer.failures import FAILURE_METADATA_KEY, FailureReason, TransferFailure, reason_from_grpc
from worker.kv_transfer.faults import NO_CHUNK_FAULTS, FaultSide
from worker.kv_transfer.interfaces import StreamingTransferSource, TransferPartsSource, TransferSource
from worker.kv_transfer.plan import ChunkPlanError, ChunkSpec, assign_streams, plan_chunks
from worker.kv_transfer.push_segment import PushSegment
from worker.kv_transfer.receiver import REQUEST_ID_METADATA_KEY, TRANSFER_ID_METADATA_KEY
from worker.kv_transfer.shm import ShmError

if TYPE_CHECKING:
    from worker.kv_transfer.sender import KvSender

logger = logging.getLogger(__name__)

# Extra wait for stream results beyond the deadline before giving up on a wedged call.
_WAIT_MARGIN_S = 2.0


# How a stream's frames ended (PushRun._frames).
_SENT = "sent"
_TRUNCATED = "truncated"
_STOPPED = "stopped"


class _PushCancelled(Exception):
    """A cancellable call ended by the push's local failure (which says why)."""


def _closed_channel(error: ValueError) -> TransferFailure:
    """grpc raises ValueError ("Cannot invoke RPC: Channel closed!") for a call started on a closed
    channel: a stream's connection-closing failure (or the fault injector's close) got there
    first, or the connection was evicted from the cache by a push to another receiver. The peer is
    unreachable on this connection; the push fails like any lost connection, it does not raise."""
    return TransferFailure(FailureReason.PEER_UNAVAILABLE, f"connection closed: {error}")


class PushRun:
    """The state of one push (its streams run in gRPC's request-consumer threads)."""

    def __init__(
        self, sender: KvSender, target: str, transfer_id: str, request_id: str, source: TransferSource, deadline_s: float
    ) -> None:
        self.sender = sender
        self.target = target
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.source = source
        self.deadline_s = deadline_s
        self.finished = threading.Event()  # interrupts fault waits when the push ends
        self._lock = threading.Lock()
        self._local_failure: TransferFailure | None = None
        self._skip_abort = False
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.num_streams = 0
        self.checksum_algorithm = 0  # negotiated at Prepare
        self._last_chunk_ends_stream = False  # the receiver said so at Prepare (no separate marker)
        self._next_sequence = 0  # the sequence number of the next chunk planned
        self.data_plane = "grpc"
        # The shared-memory segment of this push, while offered or in use (`finished` is set before
        # its release: no write starts after it).
        self._segment = PushSegment(self.finished)
        self._read_parts = source.read_parts if isinstance(source, TransferPartsSource) else None
        # Finished stream calls, and None whenever a local failure is set.
        self._done: queue.Queue[grpc.Future | None] = queue.Queue()
        self._live: Connections | None = None  # the connections in use (replaced once if closed under us)
        self.committed_with_stream = False  # the last stream carried the commit and the receiver committed
        self._reconnects = 0
        # A Prepare in progress that `cancel` may end (_cancellable_prepare), under _lock.
        self._prepare_call: grpc.Future | None = None
        injector = sender._faults
        self.faults = injector.begin_transfer(FaultSide.SENDER, transfer_id, request_id) if injector is not None else None

    def remaining_s(self) -> float:
        return self.deadline_s - self.sender._clock()

    def cancel(self, failure: TransferFailure) -> None:
        """Any thread: end the push with `failure` (KvSender.cancel). The streams' wait returns it,
        tells the receiver (Abort) and cancels the streams (`_fail`), which ends the waits of the
        streams' own threads too; a cancellable Prepare in progress is cut short."""
        self._set_local_failure(failure)

    def _set_local_failure(self, failure: TransferFailure, *, skip_abort: bool = False) -> None:
        with self._lock:
            if self._local_failure is None:
                self._local_failure = failure
                self._skip_abort = skip_abort
            prepare = self._prepare_call
        self._done.put(None)  # wakes _wait, which reads the local failure
        if prepare is not None:
            prepare.cancel()  # ends _cancellable_prepare's wait

    def _cancellable_prepare(self, on: Connections, request: pb.KvPrepareRequest, metadata: Any) -> pb.KvPrepareResponse:
        """The Prepare call as a future that a local failure cancels (raises _PushCancelled then).
        For a push started on a context still computing: its deadline is the whole transfer
        timeout, and a receiver that takes the connection but never answers (a stopped process)
        would hold it, and the blocks it pins, that long after the router gave it up. The blocking
        call the other pushes make is cheaper (about 0.15 ms less on loopback), and their deadline
        is already the router's stall bound."""
        call = on.prepare.future(request, timeout=self.remaining_s(), metadata=metadata)
        with self._lock:
            self._prepare_call = call
            failed = self._local_failure is not None
        try:
            if failed:
                call.cancel()
            return call.result()
        except grpc.FutureCancelledError:
            raise _PushCancelled from None
        except grpc.RpcError:
            if self.local_failure is not None:
                raise _PushCancelled from None  # the cancel surfaced as the call's error
            raise
        finally:
            with self._lock:
                self._prepare_call = None

    @property
    def local_failure(self) -> TransferFailure | None:
        with self._lock:
            return self._local_failure

    def _failure_from_rpc(self, error: grpc.RpcError) -> TransferFailure:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = (error.details() if isinstance(error, grpc.Call) else str(error)) or ""
        metadata = error.trailing_metadata() if isinstance(error, grpc.Call) else None
        reason = reason_from_grpc(code, metadata)
        has_reason = any(key == FAILURE_METADATA_KEY for key, _ in (metadata or ()))
        if code == grpc.StatusCode.CANCELLED and not has_reason:
            # Nobody here cancelled it (those are ignored): the connection went away under us.
            reason = FailureReason.PEER_UNAVAILABLE
        return TransferFailure(reason, details)

    def execute(self) -> TransferFailure | None:
        if (cancelled := self.local_failure) is not None:
            return cancelled  # before the Prepare: the receiver has nothing of it to abort
        try:
            connections = self.sender._connect(self.target)
        except ValueError as error:
            return TransferFailure(FailureReason.PEER_UNAVAILABLE, f"bad target {self.target!r}: {error}")
        self._live = connections
        try:
            failure = self._execute(connections)
        finally:
            self.finished.set()
            self._segment.release()
        return failure

    def _offer_shm(self) -> pb.KvShmOffer | TransferFailure | None:
        """Take a segment for this push and write the probe; None (or a failure when the plane is
        forced) when shared memory cannot be used from this side."""
        source = self.source
        try:
            return self._segment.offer(self.sender.shm_pool(), source.layout.run_bytes(source.layout.num_layers, source.num_blocks))
        except ShmError as error:
            if self.sender._config.data_plane == "shm":
                return TransferFailure(FailureReason.INCOMPATIBLE, f"shared memory unavailable: {error}")
            logger.debug("transfer %s goes over gRPC: %s", self.transfer_id, error)
            return None

    def _execute(self, connections: Connections) -> TransferFailure | None:
        metadata = self.sender._metadata
        source = self.source
        config = self.sender._config
        if self.remaining_s() <= 0:
            return TransferFailure(FailureReason.DEADLINE_EXCEEDED, "deadline passed before prepare")
        wants_shm = config.data_plane == "shm" or (config.data_plane == "auto" and not connections.shm_declined)
        offer = self._offer_shm() if wants_shm else None
        if isinstance(offer, TransferFailure):
            return offer  # nothing opened on the receiver: its reservation's timeout releases it
        request = pb.KvPrepareRequest(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            layout=codec.layout_to_proto(source.layout),
            num_blocks=source.num_blocks,
            num_streams=config.num_streams,
            max_chunk_bytes=config.max_chunk_bytes,
            timeout_s=self.remaining_s(),
            checksum_algorithms=config.checksum_algorithm_values,
            shm_offer=offer,
        )
        early = isinstance(source, StreamingTransferSource) and source.wait_ready(0, 0.0) < source.num_blocks

        def prepare(on: Connections) -> pb.KvPrepareResponse:
            request.timeout_s = self.remaining_s()
            if early:
                return self._cancellable_prepare(on, request, metadata)
            return on.prepare(request, timeout=self.remaining_s(), metadata=metadata)

        try:
            connections, answer = self._reconnecting(connections, prepare)
        except _PushCancelled:
            cancelled = self.local_failure
            assert cancelled is not None, "raised only once a local failure is set"
            return self._fail(self._live or connections, cancelled)  # its Abort: the receiver may have opened it
        except grpc.RpcError as error:
            failure = self._failure_from_rpc(error)
            if failure.reason is FailureReason.DEADLINE_EXCEEDED:
                self._send_abort(self._live or connections, failure)  # the receiver may have opened it after all
            return failure
        except ValueError as error:  # the channel was closed under us (see _closed_channel)
            return self._channel_closed(self._live or connections, error)

        # The receiver checked us; now we check the receiver, before any byte moves.
        try:
            receiver_layout = codec.layout_from_proto(answer.layout)
        except KvLayoutError as error:
            return self._fail(connections, TransferFailure(FailureReason.PROTOCOL_ERROR, f"receiver sent an invalid layout: {error}"))
        problem = source.layout.incompatibility(receiver_layout)
        if problem is None and answer.expected_num_blocks != source.num_blocks:
            problem = f"num_blocks differs: local {source.num_blocks}, receiver expects {answer.expected_num_blocks}"
        if problem is None and answer.checksum_algorithm not in config.checksum_algorithm_values:
            problem = f"receiver chose checksum algorithm {answer.checksum_algorithm}, which this side did not offer"
        if problem is not None:
            return self._fail(connections, TransferFailure(FailureReason.INCOMPATIBLE, problem))
        self.checksum_algorithm = answer.checksum_algorithm
        self._last_chunk_ends_stream = answer.last_chunk_ends_stream
        chunk_bytes = min(config.max_chunk_bytes, answer.max_chunk_bytes or config.max_chunk_bytes)
        max_streams = min(config.num_streams, max(answer.max_streams, 1))
        if answer.data_plane == pb.DATA_PLANE_SHM and offer is not None:
            self.data_plane = "shm"
        elif config.data_plane == "shm":
            return self._fail(
                connections, TransferFailure(FailureReason.INCOMPATIBLE, "the receiver cannot read this host's shared memory")
            )
        else:
            if offer is not None:
                connections.shm_declined = True
            self._segment.release()
        # A streaming source (StreamingTransferSource) whose blocks are not all final yet (a context
        # still computing) goes over one stream opened now: each part is sent the moment it is
        # final, and the commit rides with the last, so the tail pays neither a stream set-up nor a
        # round trip. A source final from the start is spread over up to max_streams streams.
        streaming = isinstance(source, StreamingTransferSource) and source.wait_ready(0, 0.0) < source.num_blocks
        if streaming:
            self.num_streams = 1
            failure = self._run_streams(connections, [self._streamed_frames(chunk_bytes)], commit_with=True)
        else:
            failure = self._send_blocks(connections, 0, source.num_blocks, chunk_bytes, max_streams)
        if failure is not None:
            return failure
        connections = self._live or connections  # the streams may have reconnected
        if self.committed_with_stream:
            return None

        commit = self._commit_request()
        try:
            self._reconnecting(connections, lambda on: on.commit(commit, timeout=max(self.remaining_s(), 0.001), metadata=metadata))
        except grpc.RpcError as error:
            return self._fail(self._live or connections, self._failure_from_rpc(error))
        except ValueError as error:
            live = self._live or connections
            return self._fail(live, self._channel_closed(live, error))
        return None

    def _reconnecting(self, connections: Connections, invoke: Callable[[Connections], Any]) -> tuple[Connections, Any]:
        """`invoke(connections)`, and once more on fresh connections when the channel was closed on
        this side before the call could start (`_reconnected`): the connections used and the result.
        A ValueError that remains (no reconnect allowed, or closed again) propagates."""
        try:
            return connections, invoke(connections)
        except ValueError:
            fresh = self._reconnected(connections)
            if fresh is None:
                raise
        return fresh, invoke(fresh)

    def _reconnected(self, closed: Connections) -> Connections | None:
        """Fresh connections to the target in place of `closed`, which were closed on this side (by
        a fault that dropped them, or the sender closing) before the call could start: the receiver
        saw nothing of that call, and a real connection loss would not leave a channel that refuses
        new calls either (gRPC reconnects). Once per push; None when it cannot or may not."""
        if self._reconnects >= 1 or self.local_failure is not None or self.remaining_s() <= 0:
            return None
        self._reconnects += 1
        self.sender._forget(self.target, closed)
        try:
            self._live = self.sender._connect(self.target)
        except (ValueError, RuntimeError):  # a bad target, or the sender itself closed
            return None
        return self._live

    def _commit_request(self) -> pb.KvCommitRequest:
        return pb.KvCommitRequest(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            chunks_sent=self.chunks_sent,
            bytes_sent=self.bytes_sent,
            output_token_ids=getattr(self.source, "output_token_ids", ()),
        )

    def _plan(self, block_start: int, block_end: int, chunk_bytes: int) -> tuple[ChunkSpec, ...] | TransferFailure:
        """The chunks of blocks [block_start, block_end), numbered after the ones planned before (and
        placed after them in the shared-memory segment, which is sized for the whole KV)."""
        source = self.source
        try:
            chunks = plan_chunks(
                source.layout, block_end - block_start, chunk_bytes, first_block=block_start, first_sequence=self._next_sequence
            )
        except ChunkPlanError as error:
            return TransferFailure(FailureReason.INCOMPATIBLE, str(error))
        self._next_sequence += len(chunks)
        if self.data_plane == "shm":
            self._segment.place(chunks, source.layout)
        return chunks

    def _send_blocks(
        self, connections: Connections, block_start: int, block_end: int, chunk_bytes: int, max_streams: int
    ) -> TransferFailure | None:
        """Send blocks [block_start, block_end), the push's last, over up to `max_streams` streams and
        wait for them (None: every stream finished; otherwise the push has failed and is cleaned up).
        Sent on one stream, that stream carries the commit."""
        chunks = self._plan(block_start, block_end, chunk_bytes)
        if isinstance(chunks, TransferFailure):
            return self._fail(connections, chunks)
        streams = assign_streams(chunks, max_streams)
        self.num_streams = max(self.num_streams, len(streams))
        # Only a lone stream can carry the commit: with several, the receiver could see the commit
        # before another stream's chunks.
        commit_with = len(streams) == 1
        return self._run_streams(connections, [self._frames(c, commit=commit_with) for c in streams], commit_with=commit_with)

    def _run_streams(self, connections: Connections, frames: list[Iterator[bytes]], *, commit_with: bool) -> TransferFailure | None:
        """Run one Push stream per frame iterator and wait for them all (None: every stream finished;
        otherwise the push has failed and is cleaned up). `commit_with`: the one stream carries the
        commit, and its response says whether the receiver committed (`committed_with_stream`)."""
        metadata = (
            *self.sender._metadata,
            (TRANSFER_ID_METADATA_KEY, self.transfer_id),
            (REQUEST_ID_METADATA_KEY, self.request_id),
        )
        done = self._done
        calls = []
        for index, stream_frames in enumerate(frames):

            def start(on: Connections, index: int = index, stream_frames: Iterator[bytes] = stream_frames) -> grpc.Future:
                # gRPC has not consumed the iterator of a call that could not start: it can go again.
                return on.pushes[index % len(on.pushes)].future(stream_frames, timeout=max(self.remaining_s(), 0.001), metadata=metadata)

            try:
                # Only the first stream may reconnect: later ones' siblings already run on these.
                connections, call = self._reconnecting(connections, start) if not calls else (connections, start(connections))
            except ValueError as error:  # closed meanwhile (an earlier stream's failure, or another push's)
                live = self._live or connections
                return self._fail(live, self.local_failure or self._channel_closed(live, error), calls)
            call.add_done_callback(done.put)
            calls.append(call)
        failure = self._wait(calls, done)
        if failure is not None:
            return self._fail(connections, failure, calls)
        if commit_with:
            self.committed_with_stream = calls[0].result().committed
        return None

    def _wait(self, calls: list[grpc.Future], done: queue.Queue[grpc.Future | None]) -> TransferFailure | None:
        """Wait for every stream; the first failure ends the wait (local failures come first: an RPC
        error is then only their consequence)."""
        pending = len(calls)
        while pending:
            try:
                call = done.get(timeout=max(self.remaining_s(), 0.0) + _WAIT_MARGIN_S)
            except queue.Empty:
                return self.local_failure or TransferFailure(FailureReason.DEADLINE_EXCEEDED, "streams did not finish")
            local = self.local_failure
            if local is not None:
                return local
            if call is None:
                continue
            pending -= 1
            try:
                error = call.exception()
            except grpc.FutureCancelledError:
                # Not by us (we stop waiting before we cancel): the channel was closed under it.
                return TransferFailure(FailureReason.PEER_UNAVAILABLE, "stream cancelled: connection closed")
            if error is not None:
                return self._failure_from_rpc(error)
        return self.local_failure

    def _channel_closed(self, connections: Connections, error: ValueError) -> TransferFailure:
        self.sender._forget(self.target, connections)
        return _closed_channel(error)

    def _fail(
        self, connections: Connections, failure: TransferFailure, calls: list[grpc.Future] | None = None
    ) -> TransferFailure:
        """Tell the receiver why, then cancel the streams and release the stream threads: in this
        order, so the receiver records our reason rather than a cut-off stream."""
        with self._lock:
            skip_abort = self._skip_abort
        if not skip_abort and failure.reason is not FailureReason.PEER_UNAVAILABLE:
            self._send_abort(connections, failure)
        for call in calls or ():
            call.cancel()
        self.finished.set()
        return failure

    def _send_abort(self, connections: Connections, failure: TransferFailure) -> None:
        try:
            connections.abort(
                pb.KvAbortRequest(
                    transfer_id=self.transfer_id,
                    request_id=self.request_id,
                    reason=codec.reason_to_proto(failure.reason),
                    detail=failure.detail[:200],
                ),
                timeout=self.sender._config.abort_timeout_s,
                metadata=self.sender._metadata,
            )
        except (grpc.RpcError, ValueError) as error:
            # Best effort: the receiver's deadline releases the reservation anyway.
            logger.debug("abort of transfer %s not delivered: %s", self.transfer_id, error)

    def _read(self, spec: ChunkSpec) -> Sequence[memoryview | bytes]:
        """The chunk's bytes, as parts when the source can hand them out without gathering."""
        if self._read_parts is not None:
            return self._read_parts(spec.layer_start, spec.layer_end, spec.block_start, spec.block_end)
        return (self.source.read(spec.layer_start, spec.layer_end, spec.block_start, spec.block_end),)

    def _write_shm(
        self, offset: int, parts: Sequence[memoryview | bytes | bytearray], size_bytes: int, *, corrupt: bool
    ) -> int | None:
        """The chunk's bytes into the segment, and their checksum (PushSegment.write); None when the
        stream must end (the push is over, or the write failed and became the push's local failure)."""
        try:
            return self._segment.write(offset, parts, size_bytes, self.checksum_algorithm, corrupt=corrupt)
        except Exception as error:  # a bug here fails this transfer, not the gRPC thread
            logger.exception("writing transfer %s into shared memory failed", self.transfer_id)
            self._set_local_failure(TransferFailure(FailureReason.INTERNAL, f"shared-memory write failed: {error}"))
            return None

    def _streamed_frames(self, chunk_bytes: int) -> Generator[bytes, None, None]:
        """The one stream of a push whose blocks become final while its context computes: each part
        as soon as the source has it, the last one ending the stream with the commit. Runs in a gRPC
        thread and never raises: a source given up, a deadline or a plan error becomes the push's
        local failure, and the stream is held open until the push has told the receiver (Abort)."""
        source = self.source
        sent_blocks = 0
        while sent_blocks < source.num_blocks:
            ready = source.wait_ready(sent_blocks, max(self.remaining_s(), 0.0))
            if self.finished.is_set():
                return
            problem: TransferFailure | None = None
            if ready < 0:
                problem = TransferFailure(FailureReason.CANCELLED, "the sender gave up its KV")
            elif ready <= sent_blocks:
                problem = TransferFailure(FailureReason.DEADLINE_EXCEEDED, "the KV was not final in time")
            else:
                chunks = self._plan(sent_blocks, ready, chunk_bytes)
                if isinstance(chunks, TransferFailure):
                    problem = chunks
            if problem is not None:
                self._set_local_failure(problem)
                self.finished.wait(max(self.remaining_s(), 0.0))
                return
            final = ready >= source.num_blocks  # the output tokens are known too (source.finish)
            ended = yield from self._frames(chunks, commit=final, end=final)
            if ended == _STOPPED or final:
                return  # the final part's frames ended the stream, with the commit
            sent_blocks = ready
            if ended == _TRUNCATED:
                break  # a clean, early end: the marker follows, and the commit finds the gap
        yield self._end_of_stream(commit=True)

    def _end_of_stream(self, *, commit: bool) -> bytes:
        return codec.encode_end_of_stream(self.transfer_id, self.request_id, self._stream_commit(commit))

    def _stream_commit(self, commit: bool) -> pb.KvCommitRequest | None:
        """The commit a stream's end carries, if `commit` and it fits a header."""
        request = self._commit_request() if commit else None
        if request is not None and request.ByteSize() > codec.MAX_HEADER_BYTES // 2:
            request = None  # many output tokens (a recovered request): a Commit call carries them
        return request

    def _frames(self, chunks: tuple[ChunkSpec, ...], *, commit: bool = False, end: bool = True) -> Generator[bytes, None, str]:
        """The encoded chunks of one stream, with the sender-side faults applied, and (`end`) its
        end, with the commit when `commit` and it fits a header: on the last chunk itself when the
        receiver offered that at Prepare and no fault touches that chunk, otherwise as a marker
        after it. Returns how it ended: _SENT, _TRUNCATED (a fault ended the stream cleanly) or
        _STOPPED (the stream must be cut: the push ended or failed). Runs in a gRPC thread: it
        never raises (a source error becomes the push's local failure and ends the stream)."""
        source = self.source
        layout = source.layout
        held: bytes | None = None
        faults = self.faults
        ended = _SENT
        last = len(chunks) - 1
        for index, spec in enumerate(chunks):
            if self.finished.is_set():
                return _STOPPED
            chunk_faults = faults.on_chunk(spec.sequence) if faults is not None else NO_CHUNK_FAULTS
            if chunk_faults is not NO_CHUNK_FAULTS:
                if chunk_faults.kill:
                    assert self.sender._faults is not None
                    self.sender._faults.kill()
                if chunk_faults.delay_s and self.finished.wait(chunk_faults.delay_s):
                    return _STOPPED
                if chunk_faults.stall:
                    self.finished.wait(max(self.remaining_s(), 0.0) + chunk_faults.stall_extra_s)
                    return _STOPPED
                if chunk_faults.close:
                    self._set_local_failure(
                        TransferFailure(FailureReason.PEER_UNAVAILABLE, "connection closed mid-stream (fault injection)"),
                        skip_abort=True,
                    )
                    self.sender.drop_connections(self.target)
                    return _STOPPED
                if chunk_faults.truncate:
                    ended = _TRUNCATED
                    break  # a clean, early end: the end-of-stream marker still follows
                if chunk_faults.drop:
                    continue
            try:
                parts = self._read(spec)
                size_bytes = sum(len(part) for part in parts)
                if size_bytes != spec.size_bytes(layout):
                    raise ValueError(f"read returned {size_bytes} bytes for a range of {spec.size_bytes(layout)}")
            except Exception as error:  # the engine's bug fails this transfer, not the gRPC thread
                logger.exception("source.read() of transfer %s raised", self.transfer_id)
                self._set_local_failure(TransferFailure(FailureReason.INTERNAL, f"source read failed: {error}"))
                # Hold the stream open until the push has told the receiver why (Abort), so the
                # receiver records INTERNAL rather than a cut-off stream.
                self.finished.wait(max(self.remaining_s(), 0.0))
                return _STOPPED
            # The stream's end rides on its last chunk (one message fewer on the critical path),
            # unless a fault touches that chunk: then the marker follows, as with an older receiver.
            ends_here = end and index == last and held is None and chunk_faults is NO_CHUNK_FAULTS and self._last_chunk_ends_stream
            if self.data_plane == "shm":
                offset = self._segment.offset(spec.sequence)
                data_checksum = self._write_shm(offset, parts, size_bytes, corrupt=chunk_faults.corrupt)
                if data_checksum is None:
                    return _STOPPED
                header = codec.make_header(self.transfer_id, self.request_id, spec, layout, data_checksum, self.checksum_algorithm)
                header.shm.offset = offset
                parts = ()  # the bytes are in the segment: the message carries the header alone
            else:
                data_checksum = codec.checksum_parts(parts, self.checksum_algorithm)
                if chunk_faults.corrupt:
                    damaged = bytearray(b"".join(parts))
                    damaged[len(damaged) // 2] ^= 0xFF
                    parts = (damaged,)
                header = codec.make_header(self.transfer_id, self.request_id, spec, layout, data_checksum, self.checksum_algorithm)
            with self._lock:
                self.chunks_sent += 1
                self.bytes_sent += size_bytes
            if ends_here:  # after the count: the commit counts this chunk
                codec.mark_end_of_stream(header, self._stream_commit(commit))
            frame = codec.encode_chunk_parts(header, parts)
            if ends_here:
                yield frame
                return ended
            if chunk_faults.reorder and held is None:
                held = frame
                continue
            yield frame
            if chunk_faults.duplicate:
                yield frame
            if held is not None:
                yield held
                held = None
        if held is not None:
            yield held
        if end:
            yield self._end_of_stream(commit=commit)
        return ended
