"""KV transfer bandwidth: duet's gRPC transport against a bare gRPC stream and a raw TCP socket,
between the same two processes, in one run; plus a single-process memory copy and the checksums.

    python bench/transfer_bench.py            # 256 MiB, 32 layers x 2 x 16-token blocks x 8 heads x 128 dims, bf16
    python bench/transfer_bench.py --quick    # 32 MiB, fewer repetitions (CI smoke)

Each repetition moves the whole request three ways, interleaved so that the machine's load hits
them alike:
  duet      KvSender.push: prepare, chunks (checksummed on both sides, XXH3-64 unless --checksum
            crc32), commit, into a MemorySink's buffer in the receiver process.
  bare gRPC the same bytes as prebuilt messages of the chunk size, over the same number of streams and
            connections with the same channel options, into a server that only copies each message
            into a buffer: no framing, no checks, no checksums. The ceiling of any gRPC Python data path.
  raw TCP   sendall of 4 MiB pieces / recv_into one preallocated buffer (piece size fixed, whatever
            --chunk-mib says, so that the baseline does not move with the knob under test).
The receiver of all three is one spawned process (worker/kv_transfer/testing.py). Medians are
reported, with the range of the per-repetition ratios. Progress goes to stderr, a table to stdout,
and the last stdout line is the JSON summary.

What was measured (2-core development machine shared with other jobs, load average 3-13, medians of
several runs; ranges in brackets):
  checksum CRC-32 -> XXH3-64: duet 0.34-0.52 -> 0.81-0.87 GB/s, ratio to raw TCP 0.24-0.44 -> 0.43-0.56.
      zlib.crc32 runs at 1.3-2.7 GB/s per core here, xxhash's XXH3-64 at 10-14 GB/s; both release
      the GIL on large buffers.
  one copy fewer on send: frames are built from the source's (layer, K|V) rows in one join
      (TransferPartsSource.read_parts) instead of gathering the rows and then joining header + data.
  GIL-free copies: a `b"".join` of views over mutable memory and a memoryview slice assignment both
      copy with the GIL held, so the chunk copies of parallel streams ran one at a time. Frames are
      now filled with numpy copies (worker/kv_transfer/frames.py) and targets written with numpy.
      On a 16-core host (the H200 machine, 2026-11-30): duet/raw TCP 0.66-0.69 -> 0.80-0.81 with
      2 streams over 2 connections, 1.04-1.05 with 4 over 4 (the new default; duet 3.5 GB/s, raw
      TCP 3.3); bare gRPC 0.85-0.93. On the 2-core development machine nothing moved: 0.43-0.53.
  what remains on 2 cores is gRPC Python's own cost. The bare gRPC stream reaches only 0.58-0.76 of
      raw TCP there: the receiving process is bound at about 1.1-1.2 cores by gRPC's completion-queue
      thread copying each message out of its slices with the GIL held (measured with a bare server:
      HTTP/2 frame size, BDP probing, the asyncio server and GIL-free sink copies do not move it).
  --streams/--connections: 4 over 4 is the default (above); on 2 cores 2x2 and 4x4 measure alike.
      --chunk-mib: 1-4 within noise; below 1 MiB per-message overhead shows.
  malloc tuning (default on; --no-tune-malloc): receiver system time about 2.0 -> 0.6 CPU-s/GiB
      (worker/kv_transfer/malloc_tuning.py).
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import msgspec  # noqa: E402
import xxhash  # noqa: E402

from bench._common import Target, emit_result, print_table, progress  # noqa: E402
from worker.kv_layout import KvLayout  # noqa: E402
from worker.kv_transfer.buffers import LinearKvBuffer  # noqa: E402
from worker.kv_transfer.config import MIB, SenderConfig, grpc_options  # noqa: E402
from worker.kv_transfer.ids import new_transfer_id  # noqa: E402
from worker.kv_transfer.malloc_tuning import tune_malloc_for_transfers  # noqa: E402
from worker.kv_transfer.sender import KvSender  # noqa: E402
from worker.kv_transfer.testing import BARE_GRPC_METHOD, ReceiverProcess  # noqa: E402

BENCH = "transfer"
TARGET_RATIO = 0.75
# One transfer's latency: duet's p50 may exceed the bare gRPC stream's by this much (Prepare and
# Commit round trips, checksums, the receiver's copies).
LATENCY_SIZES_BYTES = (64 * 1024, 1 * MIB, 4 * MIB, 16 * MIB)
LATENCY_TARGET_SIZE_BYTES = 4 * MIB
LATENCY_TARGET_EXTRA_MS = 2.0
# The shared-memory plane's 256 MiB throughput against one hot single-thread memcpy.
SHM_TARGET_RATIO = 0.35
RAW_TCP_PIECE_BYTES = 4 * MIB
CHECKSUMS = {"xxh3_64": ("XXH3_64",), "crc32": ("CRC32",)}


def make_source(layout: KvLayout, num_blocks: int, seed: int) -> LinearKvBuffer:
    size = layout.run_bytes(layout.num_layers, num_blocks)
    # Random-looking bytes (checksums and copies do not care, but compressible data could flatter a link).
    block = random.Random(seed).randbytes(min(size, 4 * MIB))
    data = bytearray(size)
    for offset in range(0, size, len(block)):
        data[offset : offset + len(block)] = block[: size - offset]
    return LinearKvBuffer(layout, num_blocks, data)


def memcpy_gbps(size_bytes: int, repetitions: int) -> float:
    source = bytearray(b"\x5a") * size_bytes
    destination = bytearray(size_bytes)
    view = memoryview(destination)
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        view[:] = source
        times.append(time.perf_counter() - start)
    return size_bytes / statistics.median(times) / 1e9


def hash_gbps(function, view: memoryview, repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        function(view)
        times.append(time.perf_counter() - start)
    return len(view) / statistics.median(times) / 1e9


def raw_tcp_once(connection: socket.socket, view: memoryview) -> float:
    start = time.perf_counter()
    connection.sendall(len(view).to_bytes(8, "little"))
    for offset in range(0, len(view), RAW_TCP_PIECE_BYTES):
        connection.sendall(view[offset : offset + RAW_TCP_PIECE_BYTES])
    if connection.recv(1) != b"k":
        raise RuntimeError("raw TCP sink did not acknowledge")
    return time.perf_counter() - start


class BareGrpc:
    """Prebuilt messages over bare client streams (the ceiling of a gRPC Python data path)."""

    def __init__(self, address: str, view: memoryview, chunk_bytes: int, num_streams: int, num_connections: int) -> None:
        options = [*grpc_options(chunk_bytes), ("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.insecure_channel(address, options) for _ in range(num_connections)]
        self._pushes = [channel.stream_unary(BARE_GRPC_METHOD) for channel in self._channels]
        messages = [bytes(view[offset : offset + chunk_bytes]) for offset in range(0, len(view), chunk_bytes)]
        self._streams = [messages[index::num_streams] for index in range(min(num_streams, len(messages)))]

    def once(self, timeout_s: float) -> float:
        start = time.perf_counter()
        calls = [
            self._pushes[index % len(self._pushes)].future(iter(stream), timeout=timeout_s)
            for index, stream in enumerate(self._streams)
        ]
        for call in calls:
            call.result()
        return time.perf_counter() - start

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def tls_cost(
    layout: KvLayout, source: LinearKvBuffer, sender_config: SenderConfig, receiver_config: dict, repetitions: int
) -> dict[str, object]:
    """The cost of the KV path's mutual TLS (what transfers between Ray nodes use by default): the
    same push to a plain and to an mTLS receiver (certificates of a DeploymentCa, as a deployment
    issues them), interleaved per repetition so that load hits both alike. Medians in GB/s."""
    from worker.kv_transfer.certificates import DeploymentCa
    from worker.kv_transfer.config import TransportSecurity

    ca = DeploymentCa("bench")
    num_blocks = source.num_blocks
    times: dict[str, list[float]] = {"plain": [], "tls": []}
    plain_receiver = ReceiverProcess(config=receiver_config)
    tls_receiver = ReceiverProcess(config=receiver_config, tls=ca.issue("receiver"))
    with (
        plain_receiver,
        tls_receiver,
        KvSender(sender_config) as plain_sender,
        KvSender(sender_config, security=TransportSecurity(tls=ca.issue("sender"))) as tls_sender,
    ):
        paths = {"plain": (plain_receiver, plain_sender), "tls": (tls_receiver, tls_sender)}
        for repetition in range(repetitions + 1):  # the first round warms connections and handshakes
            for name, (receiver, sender) in paths.items():
                transfer_id = new_transfer_id()
                receiver.expect(transfer_id, f"tls-cost-{repetition}", layout, num_blocks)
                start = time.perf_counter()
                outcome = sender.push(receiver.address, transfer_id, f"tls-cost-{repetition}", source, deadline_s=120.0)
                elapsed_s = time.perf_counter() - start
                if not outcome.ok:
                    raise RuntimeError(f"{name} push failed: {outcome.failure}")
                receiver.result(transfer_id, wait_s=10.0)
                receiver.release(transfer_id)
                if repetition:
                    times[name].append(elapsed_s)
            if repetition:
                progress(f"  tls rep {repetition}: " + ", ".join(f"{n} {source.size_bytes / t[-1] / 1e9:.3f} GB/s" for n, t in times.items()))
    plain_gbps = source.size_bytes / statistics.median(times["plain"]) / 1e9
    tls_gbps = source.size_bytes / statistics.median(times["tls"]) / 1e9
    # Per-repetition ratios (each pair ran back to back, under about the same load).
    ratios = [plain_s / tls_s for plain_s, tls_s in zip(times["plain"], times["tls"], strict=True)]
    print()
    print_table(
        ["KV path", "GB/s", "per-rep min", "per-rep max"],
        [
            ("duet gRPC, plain TCP", plain_gbps, "", ""),
            ("duet gRPC, mutual TLS (deployment CA)", tls_gbps, "", ""),
            ("TLS / plain", tls_gbps / plain_gbps, min(ratios), max(ratios)),
        ],
    )
    return {
        "plain_gbps": round(plain_gbps, 4),
        "tls_gbps": round(tls_gbps, 4),
        "ratio_tls_vs_plain": round(tls_gbps / plain_gbps, 4),
        "ratio_tls_vs_plain_range": [round(min(ratios), 4), round(max(ratios), 4)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 3 repetitions")
    parser.add_argument("--size-mib", type=int, default=None, help="bytes of KV to move (default 256, quick 32)")
    parser.add_argument("--repetitions", type=int, default=None, help="default 7, quick 3")
    parser.add_argument("--streams", type=int, default=SenderConfig().num_streams)
    parser.add_argument("--connections", type=int, default=SenderConfig().num_connections)
    parser.add_argument("--chunk-mib", type=float, default=SenderConfig().max_chunk_bytes / MIB)
    parser.add_argument("--checksum", choices=sorted(CHECKSUMS), default="xxh3_64", help="the only algorithm the sender offers")
    parser.add_argument("--no-tls", action="store_true", help="skip the mutual TLS cost section")
    parser.add_argument(
        "--no-tune-malloc", action="store_true", help="keep glibc's malloc defaults (worker/kv_transfer/malloc_tuning.py)"
    )
    parser.add_argument("--no-planes", action="store_true", help="skip the data-plane latency table and shm throughput")
    parser.add_argument("--latency-repetitions", type=int, default=None, help="timed transfers per size (default 20, quick 5)")
    args = parser.parse_args(argv)
    tuned = not args.no_tune_malloc and tune_malloc_for_transfers().applied
    size_mib = args.size_mib or (32 if args.quick else 256)
    repetitions = args.repetitions or (3 if args.quick else 7)
    chunk_bytes = int(args.chunk_mib * MIB)

    layout = KvLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype="bfloat16", model_fingerprint="bench"
    )
    num_blocks = max(1, size_mib * MIB // layout.run_bytes(layout.num_layers, 1))
    source = make_source(layout, num_blocks, seed=1)
    size_bytes = source.size_bytes
    source_crc = zlib.crc32(source.view)
    progress(f"moving {size_bytes / MIB:.0f} MiB ({num_blocks} blocks x {layout.num_layers} layers), {repetitions} repetitions")

    sender_config = SenderConfig(
        num_streams=args.streams,
        num_connections=args.connections,
        max_chunk_bytes=chunk_bytes,
        checksum_algorithms=CHECKSUMS[args.checksum],
        data_plane="grpc",  # this table is the gRPC plane against raw TCP; shared memory is measured below
    )
    receiver = ReceiverProcess(
        config={"max_chunk_bytes": max(chunk_bytes, 64 * 1024), "max_streams_per_transfer": max(args.streams, 1)},
        tune_malloc=tuned,
    )
    times: dict[str, list[float]] = {"duet": [], "bare": [], "raw": []}
    with receiver, KvSender(sender_config) as sender:
        raw_port = receiver.start_raw_tcp_sink(size_bytes)
        bare_port = receiver.start_bare_grpc_sink(size_bytes, chunk_bytes)
        bare = BareGrpc(f"127.0.0.1:{bare_port}", source.view, chunk_bytes, args.streams, args.connections)
        try:
            with socket.create_connection(("127.0.0.1", raw_port)) as raw:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # One untimed round of each warms connections, page tables and allocator pools.
                for repetition in range(repetitions + 1):
                    transfer_id = new_transfer_id()
                    request_id = f"bench-{repetition}"
                    receiver.expect(transfer_id, request_id, layout, num_blocks)
                    start = time.perf_counter()
                    outcome = sender.push(receiver.address, transfer_id, request_id, source, deadline_s=120.0)
                    duet_s = time.perf_counter() - start
                    if not outcome.ok:
                        progress(f"push failed: {outcome.failure}")
                        return 1
                    result = receiver.result(transfer_id, wait_s=10.0)
                    if result.state != "COMMITTED" or result.crc32 != source_crc:
                        progress(f"receiver state {result.state}, crc {result.crc32} != {source_crc}")
                        return 1
                    receiver.release(transfer_id)
                    bare_s = bare.once(timeout_s=120.0)
                    raw_s = raw_tcp_once(raw, source.view)
                    if repetition:
                        times["duet"].append(duet_s)
                        times["bare"].append(bare_s)
                        times["raw"].append(raw_s)
                    progress(
                        f"  rep {repetition}{' (warm-up)' if not repetition else ''}: duet {size_bytes / duet_s / 1e9:.3f} GB/s, "
                        f"bare gRPC {size_bytes / bare_s / 1e9:.3f} GB/s, raw tcp {size_bytes / raw_s / 1e9:.3f} GB/s"
                    )
        finally:
            bare.close()

    def gbps(name: str) -> float:
        return size_bytes / statistics.median(times[name]) / 1e9

    duet_gbps, bare_gbps, raw_gbps = gbps("duet"), gbps("bare"), gbps("raw")
    # Per-repetition ratios (each pair ran back to back, under about the same load).
    ratios = [raw_s / duet_s for duet_s, raw_s in zip(times["duet"], times["raw"], strict=True)]
    bare_ratios = [raw_s / bare_s for bare_s, raw_s in zip(times["bare"], times["raw"], strict=True)]
    copy_gbps = memcpy_gbps(size_bytes, repetitions)
    xxh3_gbps = hash_gbps(xxhash.xxh3_64_intdigest, source.view, repetitions)
    crc32_gbps = hash_gbps(zlib.crc32, source.view, repetitions)
    ratio = duet_gbps / raw_gbps
    bare_ratio = bare_gbps / raw_gbps

    print(
        f"KV transfer bandwidth: {size_bytes / MIB:.0f} MiB, chunks {chunk_bytes / MIB:g} MiB, {args.streams} streams over "
        f"{args.connections} connections, checksum {args.checksum}, malloc {'tuned' if tuned else 'default'}, "
        f"median of {repetitions}"
    )
    print_table(
        ["path", "GB/s"],
        [
            (f"duet gRPC transfer ({args.checksum} both sides)", duet_gbps),
            ("bare gRPC stream (prebuilt messages, copy out)", bare_gbps),
            ("raw TCP sendall/recv_into (same processes)", raw_gbps),
            ("memory copy, one process", copy_gbps),
            ("xxhash xxh3_64, one core", xxh3_gbps),
            ("zlib.crc32, one core", crc32_gbps),
        ],
    )
    print()
    print_table(
        ["ratio", "median", "per-rep min", "per-rep max"],
        [
            (f"duet / raw TCP (target >= {TARGET_RATIO})", ratio, min(ratios), max(ratios)),
            ("bare gRPC / raw TCP (gRPC Python's ceiling)", bare_ratio, min(bare_ratios), max(bare_ratios)),
            ("duet / bare gRPC", duet_gbps / bare_gbps, "", ""),
        ],
    )
    receiver_config = {"max_chunk_bytes": max(chunk_bytes, 64 * 1024), "max_streams_per_transfer": max(args.streams, 1)}
    tls_figures = {} if args.no_tls else tls_cost(layout, source, sender_config, receiver_config, repetitions)
    figures = {
        "size_mib": round(size_bytes / MIB, 1),
        "chunk_mib": chunk_bytes / MIB,
        "streams": args.streams,
        "connections": args.connections,
        "checksum": args.checksum,
        "repetitions": repetitions,
        "malloc_tuned": tuned,
        "grpc_gbps": round(duet_gbps, 4),
        "bare_grpc_gbps": round(bare_gbps, 4),
        "raw_tcp_gbps": round(raw_gbps, 4),
        "memcpy_gbps": round(copy_gbps, 4),
        "xxh3_gbps": round(xxh3_gbps, 4),
        "crc32_gbps": round(crc32_gbps, 4),
        "ratio_grpc_vs_raw_tcp": round(ratio, 4),
        "ratio_grpc_vs_raw_tcp_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "ratio_bare_grpc_vs_raw_tcp": round(bare_ratio, 4),
        "ratio_grpc_vs_bare_grpc": round(duet_gbps / bare_gbps, 4),
        **{f"tls_cost_{name}": value for name, value in tls_figures.items()},
    }
    targets = {"ratio_grpc_vs_raw_tcp": Target(ratio, TARGET_RATIO, higher_is_better=True)}
    if not args.no_planes:
        plane_figures, plane_targets = data_plane_section(
            source, sender_config, tuned, quick=args.quick, latency_repetitions=args.latency_repetitions
        )
        figures.update(plane_figures)
        targets.update(plane_targets)
    emit_result(BENCH, figures, targets)
    return 0


def _latency_source(size_bytes: int) -> LinearKvBuffer:
    """A request of exactly `size_bytes`: 8 layers of 8 KiB per (layer, block), 64 KiB per block."""
    layout = KvLayout(
        num_layers=8, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype="bfloat16", model_fingerprint="bench-latency"
    )
    return make_source(layout, size_bytes // layout.run_bytes(layout.num_layers, 1), seed=size_bytes)


def _p50_ms(times_s: list[float]) -> float:
    return statistics.median(times_s) * 1e3


def _timed_push(receiver: ReceiverProcess, sender: KvSender, source: LinearKvBuffer, plane: str, label: str) -> float:
    """One push through the real sender and receiver (the reservation and the check are not timed)."""
    transfer_id = new_transfer_id()
    receiver.expect(transfer_id, label, source.layout, source.num_blocks)
    start = time.perf_counter()
    outcome = sender.push(receiver.address, transfer_id, label, source, deadline_s=120.0)
    elapsed_s = time.perf_counter() - start
    if not outcome.ok or outcome.data_plane != plane:
        raise RuntimeError(f"{plane} push failed or took another plane: {outcome}")
    result = receiver.result(transfer_id, wait_s=10.0)
    if result.state != "COMMITTED" or result.crc32 != zlib.crc32(source.view):
        raise RuntimeError(f"{plane} push: receiver state {result.state}, wrong bytes")
    receiver.release(transfer_id)
    return elapsed_s


def latency_table(
    receiver: ReceiverProcess, senders: dict[str, KvSender], sender_config: SenderConfig, repetitions: int
) -> dict[str, dict[str, float]]:
    """p50 milliseconds of one transfer per size: duet on each plane, bare gRPC and raw TCP of the
    same bytes, interleaved per repetition so that load hits them alike."""
    table: dict[str, dict[str, float]] = {}
    chunk_bytes = sender_config.max_chunk_bytes
    for size_bytes in LATENCY_SIZES_BYTES:
        source = _latency_source(size_bytes)
        raw_port = receiver.start_raw_tcp_sink(size_bytes)
        bare_port = receiver.start_bare_grpc_sink(size_bytes, chunk_bytes)
        bare = BareGrpc(f"127.0.0.1:{bare_port}", source.view, chunk_bytes, sender_config.num_streams, sender_config.num_connections)
        times: dict[str, list[float]] = {name: [] for name in (*senders, "bare", "raw")}
        try:
            with socket.create_connection(("127.0.0.1", raw_port)) as raw:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for repetition in range(repetitions + 2):  # two untimed rounds warm pools and connections
                    for plane, sender in senders.items():
                        elapsed_s = _timed_push(receiver, sender, source, plane, f"lat-{size_bytes}-{repetition}")
                        if repetition >= 2:
                            times[plane].append(elapsed_s)
                    bare_s = bare.once(timeout_s=60.0)
                    raw_s = raw_tcp_once(raw, source.view)
                    if repetition >= 2:
                        times["bare"].append(bare_s)
                        times["raw"].append(raw_s)
        finally:
            bare.close()
        table[str(size_bytes)] = {name: _p50_ms(values) for name, values in times.items()}
        progress("  latency " + f"{size_bytes / MIB:g} MiB: " + ", ".join(f"{k} {v:.2f} ms" for k, v in table[str(size_bytes)].items()))
    return table


def shm_throughput(
    receiver: ReceiverProcess, sender: KvSender, source: LinearKvBuffer, repetitions: int
) -> tuple[float, float, list[float]]:
    """(median GB/s of whole pushes over shared memory, median GB/s of a hot single-thread memcpy of
    the same bytes, per-repetition ratios). Each push is followed by one memcpy, so that the
    machine's load hits both alike; one untimed round first pre-faults the pool's segment, the
    receiver's mapping and the memcpy's buffers."""
    destination = bytearray(source.size_bytes)
    copy_source = bytearray(source.view)
    view = memoryview(destination)
    push_times, copy_times = [], []
    for repetition in range(repetitions + 1):
        push_s = _timed_push(receiver, sender, source, "shm", f"shm-{repetition}")
        start = time.perf_counter()
        view[:] = copy_source
        copy_s = time.perf_counter() - start
        if repetition:
            push_times.append(push_s)
            copy_times.append(copy_s)
    size = source.size_bytes
    ratios = [copy_s / push_s for push_s, copy_s in zip(push_times, copy_times, strict=True)]
    return size / statistics.median(push_times) / 1e9, size / statistics.median(copy_times) / 1e9, ratios


def data_plane_section(
    source: LinearKvBuffer, sender_config: SenderConfig, tuned: bool, *, quick: bool, latency_repetitions: int | None
) -> tuple[dict[str, object], dict[str, Target]]:
    """The data planes: the latency table and the shared-memory throughput, with their targets."""
    repetitions = latency_repetitions or (5 if quick else 20)
    shm_config = msgspec.structs.replace(sender_config, data_plane="shm")
    receiver = ReceiverProcess(
        config={"max_chunk_bytes": sender_config.max_chunk_bytes, "max_streams_per_transfer": sender_config.num_streams},
        tune_malloc=tuned,
    )
    with receiver, KvSender(sender_config) as grpc_sender, KvSender(shm_config, shm_tag="bench") as shm_sender:
        progress(f"data planes: one transfer of each size, p50 of {repetitions}")
        table = latency_table(receiver, {"grpc": grpc_sender, "shm": shm_sender}, sender_config, repetitions)
        shm_gbps, copy_gbps, ratios = shm_throughput(receiver, shm_sender, source, 3 if quick else 7)
    ratio = statistics.median(ratios)
    print()
    print(f"One transfer, p50 ms of {repetitions} (duet through KvSender and KvTransferServer; the same bytes bare):")
    print_table(
        ["size", "duet grpc", "duet shm", "bare gRPC", "raw TCP", "grpc - bare", "shm - bare"],
        [
            (
                f"{int(size) // 1024} KiB" if int(size) < MIB else f"{int(size) // MIB} MiB",
                row["grpc"], row["shm"], row["bare"], row["raw"], row["grpc"] - row["bare"], row["shm"] - row["bare"],
            )
            for size, row in table.items()
        ],
    )
    print()
    print_table(
        ["shared memory, one transfer", "GB/s"],
        [
            (f"duet shm transfer of {source.size_bytes / MIB:.0f} MiB", shm_gbps),
            ("hot single-thread memcpy (bytearray slice copy, after each push)", copy_gbps),
            (f"ratio, median per repetition (target >= {SHM_TARGET_RATIO})", ratio),
            ("ratio, per-repetition range", f"{min(ratios):.3f} - {max(ratios):.3f}"),
        ],
    )
    target_row = table[str(LATENCY_TARGET_SIZE_BYTES)]
    figures: dict[str, object] = {
        "latency_p50_ms": {size: {name: round(value, 3) for name, value in row.items()} for size, row in table.items()},
        "latency_repetitions": repetitions,
        "shm_gbps": round(shm_gbps, 4),
        "shm_memcpy_gbps": round(copy_gbps, 4),
        "ratio_shm_vs_memcpy": round(ratio, 4),
        "ratio_shm_vs_memcpy_range": [round(min(ratios), 4), round(max(ratios), 4)],
    }
    targets = {
        "ratio_shm_vs_memcpy": Target(ratio, SHM_TARGET_RATIO, higher_is_better=True),
        "latency_4mib_grpc_ms": Target(target_row["grpc"], round(target_row["bare"] + LATENCY_TARGET_EXTRA_MS, 3), higher_is_better=False),
        "latency_4mib_shm_ms": Target(target_row["shm"], round(target_row["bare"] + LATENCY_TARGET_EXTRA_MS, 3), higher_is_better=False),
    }
    return figures, targets


if __name__ == "__main__":
    sys.exit(main())
