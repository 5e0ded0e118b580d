"""The receiving end of KV transfers: a gRPC server on the generation instance.

Protocol (proto/duet_wire/v1/kv_transfer.proto): Prepare checks compatibility and opens the
transfer through the engine's TransferSink; Push streams carry verified chunks into the
TransferTarget; Commit checks that every (layer, block) cell arrived exactly once and commits the
target (its OK answer is the acknowledgement); Abort ends a transfer early. Every refusal is a gRPC
status plus the FAILURE_METADATA_KEY trailing metadata naming the FailureReason.

On the shared-memory plane (worker/kv_transfer/shm.py) Prepare checks the sender's offer by
reading its probe back from the named segment; the Push streams then carry chunk headers with an
offset into that segment, and each chunk is copied out into private memory, verified on the copy
and written, under the same checks, faults and accounting as a chunk whose bytes came over gRPC.

A Push into a transfer that has already ended is FAILED_PRECONDITION (the transfer's state refuses
it, whatever its bytes): into a failed or aborted one, with the transfer's own failure reason; of
other contents into a committed one, with PROTOCOL_ERROR, and the committed blocks stay as they
are. An exact replay of a committed transfer's chunks stays OK (transfers are idempotent).

Requests are parsed by hand (codec.py), so a malformed or oversized message becomes
INVALID_ARGUMENT (or gRPC's own RESOURCE_EXHAUSTED above the message limit), never a crash.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from duet_wire.v1 import kv_transfer_pb2 as pb
from worker.kv_layout import KvLayoutError
from worker.kv_transfer import codec
from worker.kv_transfer.auth import TokenAuthInterceptor
from worker.kv_transfer.config import (
    MAX_CONTROL_MESSAGE_BYTES,
    ReceiverConfig,
    TransferConfigError,
    TransportSecurity,
    grpc_options,
)
from worker.kv_transfer.failures import FAILURE_METADATA_KEY, FailureReason, TransferFailure, TransferRejected
from worker.kv_transfer.faults import NO_CHUNK_FAULTS, FaultInjector, FaultSide, TransferFaults
from worker.kv_transfer.ids import InvalidIdentifier, check_request_id, check_transfer_id
from worker.kv_transfer.interfaces import TransferSink
from worker.kv_transfer.registry import (
    Admission,
    RegistryStats,
    TransferRecord,
    TransferRegistry,
    TransferState,
)
from worker.kv_transfer.shm import PROBE_BYTES, ScratchBuffers, SegmentReader, ShmError, copy_into, copy_out
from worker.kv_transfer.tls import ServerCertificates, TlsConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvTransfer"].full_name
MAX_BLOCKS_PER_TRANSFER = 1 << 20
_MAX_PEER_DETAIL_CHARS = 200
_DEADLINE_SLACK_S = 0.25
TRANSFER_ID_METADATA_KEY = "duet-transfer-id"
REQUEST_ID_METADATA_KEY = "duet-request-id"
_STREAM_ID_KEYS = (TRANSFER_ID_METADATA_KEY, REQUEST_ID_METADATA_KEY)


class TransferServerError(RuntimeError):
    """The server could not start (e.g. the port is taken) or was used in the wrong state."""


@dataclass(frozen=True)
class _MalformedControl:
    detail: str


def _control_decoder(message_type: type[Message]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        if len(raw) > MAX_CONTROL_MESSAGE_BYTES:
            return _MalformedControl(f"{message_type.DESCRIPTOR.name} of {len(raw)} bytes exceeds {MAX_CONTROL_MESSAGE_BYTES}")
        try:
            return message_type.FromString(raw)
        except DecodeError as error:
            return _MalformedControl(f"undecodable {message_type.DESCRIPTOR.name}: {error}")

    return decode


def _abort(context: grpc.ServicerContext, failure: TransferFailure, code: grpc.StatusCode | None = None) -> NoReturn:
    """End the call with `failure`; `code` overrides the reason's own status (the metadata still
    names the reason, which is what the sender reads)."""
    context.set_trailing_metadata(((FAILURE_METADATA_KEY, failure.reason.value),))
    context.abort(code or failure.grpc_code, failure.detail or failure.reason.value)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _protocol_error(detail: str) -> TransferFailure:
    return TransferFailure(FailureReason.PROTOCOL_ERROR, detail)


@dataclass(frozen=True)
class _Ended:
    """A chunk for a transfer that had already ended (failed, or committed with other contents):
    refused with FAILED_PRECONDITION, and the transfer is left as it is."""

    failure: TransferFailure


def _sanitize(text: str) -> str:
    clean = "".join(ch if ch.isprintable() else "?" for ch in text[:_MAX_PEER_DETAIL_CHARS])
    return clean


class KvTransferServer:
    """Serves KV transfers into `sink`. Start it, read `port`/`address`, stop it (or use `with`)."""

    def __init__(
        self,
        sink: TransferSink,
        config: ReceiverConfig | None = None,
        *,
        security: TransportSecurity | None = None,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self._config = config or ReceiverConfig()
        self._security = security or TransportSecurity()
        self._faults = faults
        self._clock = clock
        self._registry = TransferRegistry(
            max_open_transfers=self._config.max_open_transfers,
            max_streams_per_transfer=self._config.max_streams_per_transfer,
            finished_capacity=self._config.finished_capacity,
            clock=clock,
        )
        self._prepare_lock = threading.Lock()
        self._segments = SegmentReader(max_mapped=self._config.shm_max_mapped)
        self._scratch = ScratchBuffers()  # per Push-stream thread: copies out of segments land here
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._reaper: threading.Thread | None = None
        self._port: int | None = None
        # The certificate it serves, replaceable while it runs (mutual TLS only).
        self._certificates = ServerCertificates(self._security.tls) if self._security.tls is not None else None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve; returns the port (the actual one when the config says 0)."""
        if self._server is not None:
            raise TransferServerError("server already started")
        config = self._config
        interceptors = []
        if self._security.token is not None:
            interceptors.append(TokenAuthInterceptor([self._security.token]))
        server = grpc.server(
            ThreadPoolExecutor(max_workers=config.max_concurrent_rpcs, thread_name_prefix="kv-receive"),
            handlers=[self._generic_handler()],
            interceptors=interceptors,
            options=[*grpc_options(config.max_chunk_bytes), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        )
        host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
        bind_address = f"{host}:{config.port}"
        try:
            if self._certificates is not None:
                port = server.add_secure_port(bind_address, self._certificates.credentials())
            else:
                port = server.add_insecure_port(bind_address)
        except RuntimeError as error:
            raise TransferServerError(f"cannot bind {bind_address}: {error}") from error
        if port == 0:
            raise TransferServerError(f"cannot bind {bind_address}")
        server.start()
        self._server, self._port = server, port
        self._reaper = threading.Thread(target=self._reap, name="kv-receive-reaper", daemon=True)
        self._reaper.start()
        logger.info("KV transfer server listening on %s:%d", config.host, port)
        return port

    def stop(self, grace_s: float | None = None) -> None:
        """Stop serving; open transfers fail with CANCELLED (their targets are told)."""
        if self._server is None:
            return
        self._stopping.set()
        self._server.stop(self._config.stop_grace_s if grace_s is None else grace_s).wait()
        self._registry.fail_all_open(TransferFailure(FailureReason.CANCELLED, "receiver stopped"))
        if self._reaper is not None:
            self._reaper.join()
        self._segments.close()
        self._server = None

    def replace_tls(self, tls: TlsConfig) -> None:
        """Present `tls` (a reissued certificate of the same CA) to every sender that connects from
        now on; connections already open keep theirs. Only a mutual-TLS server has one to replace."""
        if self._certificates is None:
            raise TransferConfigError("this KV transfer server is plain TCP: it has no certificate to replace")
        self._certificates.replace(tls)

    def __enter__(self) -> KvTransferServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise TransferServerError("server not started")
        return self._port

    @property
    def address(self) -> str:
        """host:port for KvSender.push."""
        host = self._config.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{host}:{self.port}"

    # -- engine-facing -----------------------------------------------------------------------------

    def fail_transfer(self, transfer_id: str, failure: TransferFailure) -> bool:
        """The engine ends a transfer (e.g. its reservation expired); later chunks are refused with
        this failure. False if the transfer is unknown or already finished."""
        return self._registry.fail_by_id(transfer_id, failure)

    def expire_overdue(self) -> int:
        """Fail transfers past their deadline now (the reaper does this every reaper_interval_s)."""
        return self._registry.expire_overdue()

    def stats(self) -> RegistryStats:
        return self._registry.stats()

    def _reap(self) -> None:
        while not self._stopping.wait(self._config.reaper_interval_s):
            self._registry.expire_overdue()

    # -- gRPC handlers -----------------------------------------------------------------------------

    def _generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Prepare": grpc.unary_unary_rpc_method_handler(
                    self._prepare,
                    request_deserializer=_control_decoder(pb.KvPrepareRequest),
                    response_serializer=pb.KvPrepareResponse.SerializeToString,
                ),
                "Push": grpc.stream_unary_rpc_method_handler(
                    self._push,
                    request_deserializer=codec.decode_chunk,
                    response_serializer=pb.KvPushResponse.SerializeToString,
                ),
                "Commit": grpc.unary_unary_rpc_method_handler(
                    self._commit,
                    request_deserializer=_control_decoder(pb.KvCommitRequest),
                    response_serializer=pb.KvCommitResponse.SerializeToString,
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(
                    self._abort_transfer,
                    request_deserializer=_control_decoder(pb.KvAbortRequest),
                    response_serializer=pb.KvAbortResponse.SerializeToString,
                ),
            },
        )

    def _checked_ids(self, request: Any, context: grpc.ServicerContext) -> tuple[str, str]:
        if isinstance(request, _MalformedControl):
            _abort(context, _protocol_error(request.detail))
        try:
            return check_transfer_id(request.transfer_id), check_request_id(request.request_id)
        except InvalidIdentifier as error:
            _abort(context, _protocol_error(str(error)))

    def _prepare(self, request: pb.KvPrepareRequest, context: grpc.ServicerContext) -> pb.KvPrepareResponse:
        transfer_id, request_id = self._checked_ids(request, context)
        try:
            peer_layout = codec.layout_from_proto(request.layout)
        except KvLayoutError as error:
            _abort(context, _protocol_error(f"invalid layout: {error}"))
        if not 0 < request.num_blocks <= MAX_BLOCKS_PER_TRANSFER:
            _abort(context, _protocol_error(f"num_blocks must be in [1, {MAX_BLOCKS_PER_TRANSFER}], got {request.num_blocks}"))
        if not (math.isfinite(request.timeout_s) and request.timeout_s > 0):
            _abort(context, _protocol_error(f"timeout_s must be positive and finite, got {request.timeout_s}"))
        faults = (
            self._faults.begin_transfer(FaultSide.RECEIVER, transfer_id, request_id) if self._faults is not None else None
        )
        if faults is not None and faults.refuse():
            _abort(context, TransferFailure(FailureReason.RESOURCE_EXHAUSTED, "refused by fault injection"))
        max_chunk_bytes = min(self._config.max_chunk_bytes, request.max_chunk_bytes or self._config.max_chunk_bytes)
        timeout_s = min(request.timeout_s, self._config.max_transfer_s)
        segment = self._accept_shm(request) if request.HasField("shm_offer") else None
        with self._prepare_lock:
            existing = self._registry.open_record(transfer_id)
            if existing is not None:
                # A repeated Prepare (the sender retried after losing the answer) gets the same answer.
                if existing.request_id != request_id or existing.layout.incompatibility(peer_layout) is not None:
                    _abort(context, TransferFailure(FailureReason.UNKNOWN_TRANSFER, "no such transfer"))
                return self._prepare_response(existing, existing.deadline_s - self._clock())
            try:
                self._registry.check_new(transfer_id)
                target = self._sink.open(transfer_id, request_id, peer_layout)
            except TransferRejected as rejected:
                _abort(context, rejected.failure)
            except Exception as error:  # the engine's bug must not take the server down
                logger.exception("sink.open(%s) raised", transfer_id)
                _abort(context, TransferFailure(FailureReason.INTERNAL, f"sink failed to open: {type(error).__name__}"))
            checksum_algorithm = codec.choose_checksum(list(request.checksum_algorithms))
            problem = target.layout.incompatibility(peer_layout)
            if problem is None and checksum_algorithm is None:
                problem = f"no common checksum algorithm (offered {list(request.checksum_algorithms)})"
            if problem is None and target.num_blocks != request.num_blocks:
                problem = f"num_blocks differs: local {target.num_blocks}, peer {request.num_blocks}"
            if problem is None and target.layout.block_bytes_per_layer > max_chunk_bytes:
                problem = (
                    f"one block of one layer ({target.layout.block_bytes_per_layer} bytes) exceeds the chunk "
                    f"limit of {max_chunk_bytes} bytes"
                )
            if problem is not None:
                failure = TransferFailure(FailureReason.INCOMPATIBLE, problem)
                try:
                    target.fail(failure)
                except Exception:
                    logger.exception("target.fail() of refused transfer %s raised", transfer_id)
                _abort(context, failure)
            record = self._registry.add(transfer_id, request_id, target, target.num_blocks, max_chunk_bytes, timeout_s)
            assert checksum_algorithm is not None
            record.checksum_algorithm = checksum_algorithm
            record.shm_segment = segment
            if faults is not None and faults.active:
                record.faults = faults
        logger.debug("opened transfer %s for request %s (%d blocks)", transfer_id, request_id, target.num_blocks)
        return self._prepare_response(record, timeout_s)

    def _accept_shm(self, request: pb.KvPrepareRequest) -> Any:
        """The sender's segment, mapped, if this receiver takes the shared-memory plane and reads the
        offer's probe back (same host, same shared-memory namespace, same user); None: gRPC."""
        if self._config.data_plane == "grpc":
            return None
        offer = request.shm_offer
        if len(offer.probe) != PROBE_BYTES:
            return None
        try:
            segment = self._segments.open(offer.segment)
            seen = copy_out(segment, offer.probe_offset, PROBE_BYTES)
        except ShmError as error:
            logger.debug("transfer %s: shared-memory offer not taken: %s", request.transfer_id, error)
            return None
        return segment if bytes(seen) == offer.probe else None

    def _prepare_response(self, record: TransferRecord, timeout_s: float) -> pb.KvPrepareResponse:
        return pb.KvPrepareResponse(
            data_plane=pb.DATA_PLANE_SHM if record.shm_segment is not None else pb.DATA_PLANE_GRPC,
            layout=codec.layout_to_proto(record.layout),
            expected_num_blocks=record.num_blocks,
            max_chunk_bytes=record.max_chunk_bytes,
            max_streams=self._config.max_streams_per_transfer,
            timeout_s=max(timeout_s, 0.0),
            checksum_algorithm=record.checksum_algorithm,
            last_chunk_ends_stream=True,
        )

    def _push(self, request_iterator: Any, context: grpc.ServicerContext) -> pb.KvPushResponse:
        failure: TransferFailure | None = None
        ended_transfer: _Ended | None = None
        commit: pb.KvCommitRequest | None = None  # carried by the end of a push's last stream
        accepted = duplicates = 0
        accepted_bytes = 0
        # The stream names its transfer up front, so the transfer hears of a stream that breaks
        # before its first chunk.
        stream_ids = {key: value for key, value in context.invocation_metadata() if key in _STREAM_ID_KEYS}
        if set(stream_ids) != set(_STREAM_ID_KEYS):
            _abort(context, _protocol_error(f"Push needs the metadata keys {sorted(_STREAM_ID_KEYS)}"))
        try:
            record = self._registry.find(stream_ids[TRANSFER_ID_METADATA_KEY], stream_ids[REQUEST_ID_METADATA_KEY])
            self._registry.attach_stream(record)
        except TransferRejected as rejected:
            _abort(context, rejected.failure)
        attached = True
        ended = False
        try:
            for chunk in request_iterator:
                if isinstance(chunk, codec.MalformedChunk):
                    failure = _protocol_error(chunk.detail)
                    break
                header = chunk.header
                if header.transfer_id != record.transfer_id or header.request_id != record.request_id:
                    failure = _protocol_error("a stream carries chunks of its own transfer only")
                    break
                if ended:
                    failure = _protocol_error("a message followed the end of the stream")
                    break
                # A marker alone names no bytes; a last chunk that ends the stream does (we offered
                # last_chunk_ends_stream at Prepare): it is written first, like any chunk.
                if not header.end_of_stream or header.byte_length:
                    result = self._handle_chunk(record, chunk)
                    if isinstance(result, _Ended):
                        ended_transfer = result
                        break
                    if isinstance(result, TransferFailure):
                        failure = result
                        break
                    if result is Admission.WRITE:
                        accepted += 1
                        accepted_bytes += header.byte_length
                    elif result is Admission.DUPLICATE:
                        duplicates += 1
                elif len(chunk.data):
                    failure = _protocol_error("the end-of-stream marker carries no data")
                    break
                if header.end_of_stream:
                    ended = True
                    if header.HasField("commit"):
                        # The push's last message: commit now rather than after the sender's
                        # half-close (a message after it goes unread, and the commit stands).
                        commit = header.commit
                        break
        except grpc.RpcError:
            # The sender went away (or its deadline passed) mid-stream; nobody reads our answer.
            self._registry.fail(record, self._cut_off(record, context))
            return pb.KvPushResponse()
        finally:
            if attached:
                self._registry.detach_stream(record)
        if ended_transfer is not None:
            _abort(context, ended_transfer.failure, grpc.StatusCode.FAILED_PRECONDITION)
        if failure is None and not ended:
            # gRPC reports a dropped connection as a clean end at times; the end-of-stream mark tells them apart.
            self._registry.fail(record, self._cut_off(record, context))
            _abort(context, record.failure or _protocol_error("stream ended without its end-of-stream mark"))
        if failure is not None:
            self._registry.fail(record, failure)
            _abort(context, record.failure or failure)
        if record.state is TransferState.FAILED and record.failure is not None:
            # Failed before this stream's chunks or beside them (an Abort, another stream, the
            # deadline): not this stream's doing, so the transfer's state refuses it.
            _abort(context, record.failure, grpc.StatusCode.FAILED_PRECONDITION)
        response = pb.KvPushResponse(chunks_accepted=accepted, chunks_duplicate=duplicates, bytes_accepted=accepted_bytes)
        if commit is not None:
            # The push's last stream carried the commit: the same checks as a Commit call, without
            # the round trip after the stream.
            if commit.transfer_id != record.transfer_id or commit.request_id != record.request_id:
                _abort(context, _protocol_error("a stream's commit names another transfer"))
            try:
                receipt = self._registry.commit(record, commit.chunks_sent, commit.bytes_sent, tuple(commit.output_token_ids))
            except TransferRejected as rejected:
                _abort(context, rejected.failure)
            logger.debug("committed transfer %s with its last stream (%d bytes)", record.transfer_id, receipt.bytes_received)
            response.committed = True
            response.chunks_received = receipt.chunks_received
            response.bytes_received = receipt.bytes_received
        return response

    def _cut_off(self, record: TransferRecord, context: grpc.ServicerContext) -> TransferFailure:
        remaining_s = context.time_remaining()
        # The sender's deadline fires a little before ours (its clock started first), so a stream
        # cut just short of the deadline was cut by it.
        if (remaining_s is not None and remaining_s <= _DEADLINE_SLACK_S) or (
            self._clock() >= record.deadline_s - _DEADLINE_SLACK_S
        ):
            return TransferFailure(FailureReason.DEADLINE_EXCEEDED, "deadline passed mid-stream")
        return TransferFailure(
            FailureReason.PEER_UNAVAILABLE, "sender's stream broke off (no end-of-stream mark, no Abort)"
        )

    def _handle_chunk(
        self, record: TransferRecord, chunk: codec.DecodedChunk
    ) -> Admission | TransferFailure | _Ended | None:
        """Verify and write one chunk. Returns its admission, None if a fault dropped it, the failure
        that ends the stream (and the transfer), or _Ended when the transfer had already ended."""
        header = chunk.header
        in_shm = header.HasField("shm")
        if in_shm and (record.shm_segment is None or len(chunk.data)):
            return _protocol_error("a shared-memory chunk names no bytes of a segment this transfer accepted")
        data_length = header.byte_length if in_shm else len(chunk.data)
        problem = codec.header_problem(
            header, data_length, record.layout, record.num_blocks, record.max_chunk_bytes, record.checksum_algorithm
        )
        if problem is not None:
            return _protocol_error(problem)
        if isinstance(record.faults, TransferFaults):
            faults = record.faults.on_chunk(header.sequence)
            if faults is not NO_CHUNK_FAULTS:
                applied = self._apply_faults(record, faults)
                if applied is not True:
                    return applied
        if record.state is TransferState.FAILED:
            # Read without the lock: a transfer that fails just after is refused below with its own
            # failure, which is as true.
            return _Ended(record.failure or TransferFailure(FailureReason.CANCELLED, "the transfer has ended"))
        admission = self._registry.admit(record, codec.spec_of(header), header.checksum)
        if admission is Admission.CONFLICT:
            return _Ended(_protocol_error(f"chunk {header.sequence} differs from what the committed transfer accepted"))
        if admission is Admission.LATE:
            # Dropped; a failed transfer's failure ends the stream, a committed one's replayed chunk does not.
            return record.failure if record.state is TransferState.FAILED else admission
        if admission is Admission.DUPLICATE:
            return admission
        failure: TransferFailure | None = None
        try:
            if in_shm:
                data, actual = self._copy_from_segment(record, header, data_length)
            else:
                data, actual = chunk.data, codec.checksum(chunk.data, record.checksum_algorithm)
            if actual != header.checksum:
                failure = TransferFailure(
                    FailureReason.CHECKSUM_MISMATCH,
                    f"chunk {header.sequence}: checksum {actual:#x}, header says {header.checksum:#x}",
                )
            elif data is not None:
                record.target.write(header.layer_start, header.layer_end, header.block_start, header.block_end, data)
        except TransferRejected as rejected:
            failure = rejected.failure
        except ShmError as error:
            failure = _protocol_error(str(error))
        except Exception as error:  # the engine's bug fails this transfer, not the server
            logger.exception("target.write() of transfer %s raised", record.transfer_id)
            failure = TransferFailure(FailureReason.INTERNAL, f"target write failed: {type(error).__name__}")
        finally:
            self._registry.finish_write(record, data_length)
        return failure if failure is not None else admission

    def _copy_from_segment(
        self, record: TransferRecord, header: pb.KvChunkHeader, length: int
    ) -> tuple[memoryview | None, int]:
        """Copy a shared-memory chunk out of the sender's segment and checksum the copy (the sender
        can still write the segment; its checksum covers what it wrote). A TransferViewsTarget gets
        the bytes straight into its storage, checksummed there while it holds them (returns None:
        nothing left to write); otherwise they go to this thread's scratch buffer, returned for `write`."""
        fill = getattr(record.target, "fill", None)
        if fill is not None:
            checksums: list[int] = []

            def copy(views: Sequence[memoryview]) -> None:
                copy_into(record.shm_segment, header.shm.offset, views)
                checksums.append(codec.checksum_parts(views, record.checksum_algorithm))

            if fill(header.layer_start, header.layer_end, header.block_start, header.block_end, copy):
                return None, checksums[0]
        data = copy_out(record.shm_segment, header.shm.offset, length, self._scratch.get(length))
        return data, codec.checksum(data, record.checksum_algorithm)

    def _apply_faults(self, record: TransferRecord, faults: Any) -> TransferFailure | None | bool:
        """Receiver-side faults; True: go on handling the chunk."""
        assert self._faults is not None
        if faults.kill:
            self._faults.kill()
        if faults.delay_s:
            self._stopping.wait(faults.delay_s)
        if faults.stall:
            self._stopping.wait(max(0.0, record.deadline_s - self._clock()) + faults.stall_extra_s)
        if faults.expire:
            failure = TransferFailure(FailureReason.RESERVATION_EXPIRED, "reservation expired (fault injection)")
            self._registry.fail(record, failure)
            return record.failure or failure
        if faults.drop:
            return None
        return True

    def _commit(self, request: pb.KvCommitRequest, context: grpc.ServicerContext) -> pb.KvCommitResponse:
        transfer_id, request_id = self._checked_ids(request, context)
        try:
            record = self._registry.find(transfer_id, request_id)
            receipt = self._registry.commit(record, request.chunks_sent, request.bytes_sent, tuple(request.output_token_ids))
        except TransferRejected as rejected:
            _abort(context, rejected.failure)
        logger.debug("committed transfer %s (%d bytes)", transfer_id, receipt.bytes_received)
        return pb.KvCommitResponse(chunks_received=receipt.chunks_received, bytes_received=receipt.bytes_received)

    def _abort_transfer(self, request: pb.KvAbortRequest, context: grpc.ServicerContext) -> pb.KvAbortResponse:
        transfer_id, request_id = self._checked_ids(request, context)
        try:
            record = self._registry.find(transfer_id, request_id)
        except TransferRejected as rejected:
            _abort(context, rejected.failure)
        reason = codec.reason_from_proto(request.reason) or FailureReason.CANCELLED
        detail = "aborted by sender" + (f": {_sanitize(request.detail)}" if request.detail else "")
        return pb.KvAbortResponse(aborted=self._registry.fail(record, TransferFailure(reason, detail)))
