"""Frozen, validated configuration of the transfer server and sender, and their gRPC options."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.kv_transfer.auth import TokenError, check_token
from worker.kv_transfer.codec import FRAME_OVERHEAD_BYTES, SUPPORTED_CHECKSUMS, checksum_name
from worker.kv_transfer.tls import TlsConfig

MIB = 1 << 20
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 64 * MIB
# Unary messages (Prepare, Commit, Abort) are tiny; anything larger is refused by gRPC itself.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024
# The checksum algorithms this side implements, by configuration name ("XXH3_64", "CRC32").
CHECKSUM_ALGORITHM_NAMES: dict[str, int] = {checksum_name(value): value for value in SUPPORTED_CHECKSUMS}


class TransferConfigError(ValueError):
    """An invalid configuration value (the message names the field)."""


def _positive_int(name: str, value: object, *, low: int = 1, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise TransferConfigError(f"{name} must be an integer {bound}, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TransferConfigError(f"{name} must be a positive finite number, got {value!r}")


_C = TypeVar("_C")


def _from_mapping(cls: type[_C], data: Mapping[str, Any]) -> _C:
    if not isinstance(data, Mapping):
        raise TransferConfigError(f"{cls.__name__} config must be a mapping, got {type(data).__name__}")
    known = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise TransferConfigError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    return cls(**data)


@dataclass(frozen=True)
class ReceiverConfig:
    """The KV transfer server of a generation (or mixed) instance."""

    host: str = "127.0.0.1"
    # 0 picks a free port; KvTransferServer.port tells which.
    port: int = 0
    # Open transfers beyond this are refused with RESOURCE_EXHAUSTED at Prepare.
    max_open_transfers: int = 16
    max_streams_per_transfer: int = 4
    # Largest chunk payload accepted; the gRPC message limit is this plus a small header allowance.
    max_chunk_bytes: int = 4 * MIB
    # Upper bound on any transfer's lifetime, whatever the sender asks for.
    max_transfer_s: float = 120.0
    # How often overdue transfers are failed (DEADLINE_EXCEEDED) and their targets released.
    reaper_interval_s: float = 0.25
    # Finished transfer ids remembered, so late chunks are dropped quietly and retries answered.
    finished_capacity: int = 4096
    stop_grace_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise TransferConfigError(f"host must be a non-empty string, got {self.host!r}")
        _positive_int("port", self.port, low=0, high=65535)
        _positive_int("max_open_transfers", self.max_open_transfers, high=4096)
        _positive_int("max_streams_per_transfer", self.max_streams_per_transfer, high=64)
        _positive_int("max_chunk_bytes", self.max_chunk_bytes, low=MIN_CHUNK_BYTES, high=MAX_CHUNK_BYTES)
        _positive_float("max_transfer_s", self.max_transfer_s)
        _positive_float("reaper_interval_s", self.reaper_interval_s)
        _positive_int("finished_capacity", self.finished_capacity, high=1 << 20)
        _positive_float("stop_grace_s", self.stop_grace_s)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ReceiverConfig:
        return _from_mapping(cls, data)

    @property
    def max_concurrent_rpcs(self) -> int:
        """Every stream of every open transfer, plus room for the unary calls."""
        return self.max_open_transfers * self.max_streams_per_transfer + 2 * self.max_open_transfers + 4


@dataclass(frozen=True)
class SenderConfig:
    """The KV sender of a prefill (or mixed) instance."""

    # Parallel Push streams per transfer (fewer if the receiver allows fewer or there are fewer chunks).
    # 4 over 4 connections: 1.04 of raw TCP on a 16-core host against 0.80 with 2 over 2 (the streams'
    # copies run on separate cores); on 2 cores the same as 2 over 2 (bench/transfer_bench.py).
    num_streams: int = 4
    # Separate TCP connections per receiver; streams are spread over them.
    num_connections: int = 4
    max_chunk_bytes: int = 4 * MIB
    # Time allowed for the best-effort Abort sent after a failure.
    abort_timeout_s: float = 1.0
    # Checksum algorithms offered at Prepare, most preferred first (ChecksumAlgorithm names without
    # their prefix). XXH3_64 is about 5x cheaper per byte than CRC32; CRC32 is what older receivers speak.
    checksum_algorithms: tuple[str, ...] = ("XXH3_64", "CRC32")

    def __post_init__(self) -> None:
        _positive_int("num_streams", self.num_streams, high=64)
        _positive_int("num_connections", self.num_connections, high=64)
        _positive_int("max_chunk_bytes", self.max_chunk_bytes, low=MIN_CHUNK_BYTES, high=MAX_CHUNK_BYTES)
        _positive_float("abort_timeout_s", self.abort_timeout_s)
        if isinstance(self.checksum_algorithms, list):
            object.__setattr__(self, "checksum_algorithms", tuple(self.checksum_algorithms))  # from YAML/JSON
        names = self.checksum_algorithms
        if (
            not isinstance(names, tuple)
            or not names
            or len(set(names)) != len(names)
            or any(name not in CHECKSUM_ALGORITHM_NAMES for name in names)
        ):
            raise TransferConfigError(
                f"checksum_algorithms must be a non-empty list of distinct names from {sorted(CHECKSUM_ALGORITHM_NAMES)}, "
                f"got {names!r}"
            )

    @property
    def checksum_algorithm_values(self) -> tuple[int, ...]:
        """The offered algorithms as ChecksumAlgorithm values, in order."""
        return tuple(CHECKSUM_ALGORITHM_NAMES[name] for name in self.checksum_algorithms)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SenderConfig:
        return _from_mapping(cls, data)


@dataclass(frozen=True)
class TransportSecurity:
    """How instances authenticate each other: a shared cluster token, mutual TLS, both, or (tests and
    single-box setups only) neither."""

    token: str | None = None
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            try:
                check_token(self.token)
            except TokenError as error:
                raise TransferConfigError(f"token: {error}") from None
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise TransferConfigError(f"tls must be a TlsConfig, got {type(self.tls).__name__}")

    def __repr__(self) -> str:  # never print the token
        return f"TransportSecurity(token={'<set>' if self.token else None}, tls={'<set>' if self.tls else None})"


def grpc_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    """Channel and server options shared by both ends of the transfer path (measured in
    bench/transfer_bench.py: message limits at the chunk size, a large HTTP/2 write buffer and
    read chunk so a chunk moves in few syscalls)."""
    message_limit = max_chunk_bytes + FRAME_OVERHEAD_BYTES
    return [
        ("grpc.max_receive_message_length", message_limit),
        ("grpc.max_send_message_length", message_limit),
        ("grpc.http2.write_buffer_size", max_chunk_bytes),
        ("grpc.experimental.tcp_read_chunk_size", max_chunk_bytes),
        ("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024),
        ("grpc.experimental.tcp_max_read_chunk_size", max_chunk_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
