"""Two processes on 127.0.0.1: a receiver (spawned, with an in-memory sink) and the sender (this
process). The bytes that arrive are exactly the bytes that were sent, for several layouts, sizes,
chunkings and stream counts."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from worker.kv_layout import KvLayout
from worker.kv_transfer import codec
from worker.kv_transfer.buffers import LinearKvBuffer
from worker.kv_transfer.config import SenderConfig
from worker.kv_transfer.ids import new_transfer_id
from worker.kv_transfer.sender import KvSender
from worker.kv_transfer.testing import ReceiverProcess

pytestmark = pytest.mark.timeout(120)

KIB = 1024


@pytest.fixture(scope="module")
def receiver():
    with ReceiverProcess(config={"max_chunk_bytes": 256 * KIB, "max_streams_per_transfer": 4}) as process:
        yield process


def _source(layout: KvLayout, num_blocks: int, seed: int) -> LinearKvBuffer:
    size = layout.run_bytes(layout.num_layers, num_blocks)
    return LinearKvBuffer(layout, num_blocks, bytearray(random.Random(seed).randbytes(size)))


CASES = [
    # (layout, num_blocks, chunk bytes, streams): whole-layer chunks, split layers with a partial last
    # chunk, a single block, and each dtype.
    (KvLayout(4, 2, 64, 16, "bfloat16", "llama-a"), 37, 64 * KIB, 3),
    (KvLayout(4, 2, 64, 16, "bfloat16", "llama-a"), 5, 256 * KIB, 2),
    (KvLayout(3, 1, 32, 8, "float32", "tiny"), 1, 64 * KIB, 4),
    (KvLayout(2, 4, 128, 16, "float16", "mistral-b"), 13, 100 * KIB, 1),
    (KvLayout(6, 2, 16, 4, "float32", "qwen-c"), 129, 64 * KIB, 4),
]


@pytest.mark.parametrize(("layout", "num_blocks", "chunk_bytes", "streams"), CASES)
def test_bytes_arrive_identical(receiver: ReceiverProcess, layout: KvLayout, num_blocks: int, chunk_bytes: int, streams: int) -> None:
    source = _source(layout, num_blocks, seed=num_blocks)
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, f"req-{num_blocks}", layout, num_blocks)
    with KvSender(SenderConfig(num_streams=streams, num_connections=2, max_chunk_bytes=chunk_bytes)) as sender:
        outcome = sender.push(receiver.address, transfer_id, f"req-{num_blocks}", source, deadline_s=30.0)
    assert outcome.ok, outcome.failure
    assert outcome.bytes_sent == source.size_bytes
    assert outcome.num_streams == min(streams, outcome.chunks_sent)
    result, data = receiver.received_bytes(transfer_id)
    assert result.state == "COMMITTED" and result.events == ("commit",)
    assert data == bytes(source.view)


class _ReadOnlySource:
    """A TransferSource with `read` only (an engine's own source has no `read_parts`)."""

    def __init__(self, buffer: LinearKvBuffer) -> None:
        self.layout = buffer.layout
        self.num_blocks = buffer.num_blocks
        self._buffer = buffer

    def read(self, layer_start: int, layer_end: int, block_start: int, block_end: int) -> bytes:
        return bytes(self._buffer.read(layer_start, layer_end, block_start, block_end))


@pytest.mark.parametrize(
    ("checksums", "read_only"),
    [(("XXH3_64", "CRC32"), False), (("CRC32",), False), (("XXH3_64",), True), (("CRC32", "XXH3_64"), True)],
)
def test_every_checksum_and_source_kind_arrives_identical(receiver: ReceiverProcess, checksums, read_only: bool) -> None:
    layout = KvLayout(4, 2, 64, 16, "bfloat16", "llama-a")
    # 64 KiB chunks split each layer into block ranges, so the parts path joins (layer, K|V) rows.
    buffer = _source(layout, 11, seed=len(checksums) + read_only)
    source = _ReadOnlySource(buffer) if read_only else buffer
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, "checksums", layout, buffer.num_blocks)
    config = SenderConfig(num_streams=2, max_chunk_bytes=64 * KIB, checksum_algorithms=checksums)
    with KvSender(config) as sender:
        outcome = sender.push(receiver.address, transfer_id, "checksums", source, deadline_s=30.0)
    assert outcome.ok, outcome.failure
    result, data = receiver.received_bytes(transfer_id)
    assert result.state == "COMMITTED" and data == bytes(buffer.view)


def test_concurrent_pushes_over_one_sender(receiver: ReceiverProcess) -> None:
    layout = KvLayout(4, 2, 64, 16, "bfloat16", "llama-a")
    sources = [_source(layout, 9 + index, seed=100 + index) for index in range(4)]
    transfer_ids = [new_transfer_id() for _ in sources]
    for index, (transfer_id, source) in enumerate(zip(transfer_ids, sources, strict=True)):
        receiver.expect(transfer_id, f"conc-{index}", layout, source.num_blocks)
    outcomes = [None] * len(sources)
    with KvSender(SenderConfig(num_streams=2, max_chunk_bytes=64 * KIB)) as sender:

        def push(index: int) -> None:
            outcomes[index] = sender.push(receiver.address, transfer_ids[index], f"conc-{index}", sources[index], 30.0)

        threads = [threading.Thread(target=push, args=(index,)) for index in range(len(sources))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(outcome is not None and outcome.ok for outcome in outcomes), outcomes
    for transfer_id, source in zip(transfer_ids, sources, strict=True):
        result, data = receiver.received_bytes(transfer_id)
        assert result.state == "COMMITTED" and data == bytes(source.view)


class _WithTokens(LinearKvBuffer):
    """A source whose request has output tokens for the commit (a prefill's first token, or many
    after a recovery)."""

    output_token_ids: tuple[int, ...] = ()


def _counting_commits(sender: KvSender, address: str, monkeypatch) -> list[int]:
    """Commit calls the sender makes to `address` (its connections are cached: the push uses them)."""
    connections = sender._connect(address)
    calls: list[int] = []
    real = connections.commit

    def commit(request, **kwargs):
        calls.append(len(request.output_token_ids))
        return real(request, **kwargs)

    monkeypatch.setattr(connections, "commit", commit)
    return calls


@pytest.mark.parametrize(
    ("streams", "num_tokens", "commit_calls"),
    [
        (1, 1, 0),  # one stream: it carries the commit, no Commit round trip follows
        (3, 1, 1),  # several streams: a Commit call after the last one ends
        (1, 2000, 1),  # too many tokens for a chunk header: a Commit call carries them
    ],
)
def test_the_last_lone_stream_carries_the_commit(
    receiver: ReceiverProcess, monkeypatch, streams: int, num_tokens: int, commit_calls: int
) -> None:
    layout = KvLayout(4, 2, 64, 16, "bfloat16", "llama-a")
    size = layout.run_bytes(layout.num_layers, 7)
    source = _WithTokens(layout, 7, bytearray(random.Random(streams).randbytes(size)))
    source.output_token_ids = tuple(range(7, 7 + num_tokens))
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, f"fold-{streams}-{num_tokens}", layout, 7)
    with KvSender(SenderConfig(num_streams=streams, num_connections=1, max_chunk_bytes=64 * KIB)) as sender:
        calls = _counting_commits(sender, receiver.address, monkeypatch)
        outcome = sender.push(
            receiver.address, transfer_id, f"fold-{streams}-{num_tokens}", source, deadline_s=30.0
        )
    assert outcome.ok, outcome.failure
    assert outcome.num_streams == streams
    assert calls == [num_tokens] * commit_calls
    result, data = receiver.received_bytes(transfer_id)
    assert result.state == "COMMITTED" and result.events == ("commit",)  # committed exactly once
    assert data == bytes(source.view)


class _Streamed(_WithTokens):
    """A StreamingTransferSource: its blocks become final in `steps` parts (a context computing in
    chunks), the output tokens with the last."""

    def __init__(self, layout: KvLayout, num_blocks: int, data: bytearray, steps: int) -> None:
        super().__init__(layout, num_blocks, data)
        self._ready = threading.Condition()
        self._ready_blocks = 0
        self._parts = [num_blocks * (step + 1) // steps for step in range(steps)]

    def wait_ready(self, have_blocks: int, timeout_s: float) -> int:
        with self._ready:
            self._ready.wait_for(lambda: self._ready_blocks > have_blocks, timeout=timeout_s)
            return self._ready_blocks

    def compute(self, tokens: tuple[int, ...]) -> None:
        for ready in self._parts:
            time.sleep(0.01)
            with self._ready:
                if ready == self.num_blocks:
                    self.output_token_ids = tokens
                self._ready_blocks = ready
                self._ready.notify_all()


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("offered", [True, False])
def test_the_stream_ends_on_its_last_chunk_when_the_receiver_offers_it(
    receiver: ReceiverProcess, monkeypatch, offered: bool, streamed: bool
) -> None:
    """A receiver that offers last_chunk_ends_stream at Prepare (every current one) gets the stream's
    end and the commit on the last chunk: no separate marker, no Commit call. One that does not (a
    peer from before it) gets the marker after the last chunk. Both commit the same bytes once."""
    layout = KvLayout(4, 2, 64, 16, "bfloat16", "llama-a")
    size = layout.run_bytes(layout.num_layers, 9)
    data = bytearray(random.Random(9 + offered + 2 * streamed).randbytes(size))
    source = _Streamed(layout, 9, data, steps=3) if streamed else _WithTokens(layout, 9, data)
    tokens = (42,)
    if not streamed:
        source.output_token_ids = tokens
    request_id = f"ends-{offered}-{streamed}"
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, request_id, layout, 9)
    markers: list[bytes] = []
    real_marker = codec.encode_end_of_stream

    def marker(*args, **kwargs) -> bytes:
        markers.append(real_marker(*args, **kwargs))
        return markers[-1]

    monkeypatch.setattr(codec, "encode_end_of_stream", marker)
    with KvSender(SenderConfig(num_streams=1, num_connections=1, max_chunk_bytes=64 * KIB)) as sender:
        connections = sender._connect(receiver.address)
        real_prepare = connections.prepare
        offers: list[bool] = []

        def seen(answer):
            offers.append(answer.last_chunk_ends_stream)
            if not offered:
                answer.last_chunk_ends_stream = False  # as a receiver from before the field answers
            return answer

        class Prepare:  # the blocking call, and the cancellable one a push on a computing context makes
            def __call__(self, request, **kwargs):
                return seen(real_prepare(request, **kwargs))

            def future(self, request, **kwargs):
                call = real_prepare.future(request, **kwargs)
                return SimpleNamespace(result=lambda: seen(call.result()), cancel=call.cancel)

        monkeypatch.setattr(connections, "prepare", Prepare())
        commits = _counting_commits(sender, receiver.address, monkeypatch)
        computing = threading.Thread(target=source.compute, args=(tokens,)) if streamed else None
        if computing is not None:
            computing.start()
        outcome = sender.push(receiver.address, transfer_id, request_id, source, deadline_s=30.0)
        if computing is not None:
            computing.join()
    assert outcome.ok, outcome.failure
    assert offers == [True]  # the receiver offers it
    assert len(markers) == (0 if offered else 1)
    assert commits == []  # the stream carried the commit either way
    assert outcome.chunks_sent > 1 and outcome.bytes_sent == size
    result, received = receiver.received_bytes(transfer_id)
    assert result.state == "COMMITTED" and result.events == ("commit",)
    assert received == bytes(data)
