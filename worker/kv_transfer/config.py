"""Frozen, validated configuration of the transfer server and sender, and their gRPC options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta

from worker.config import ConfigProblem, ConfigStruct, PositiveFloat, ProblemKind, load_config
from worker.kv_transfer.auth import TokenError, check_token
from worker.kv_transfer.codec import FRAME_OVERHEAD_BYTES, SUPPORTED_CHECKSUMS, checksum_name
from worker.kv_transfer.tls import TlsConfig

MIB = 1 << 20
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 64 * MIB
# Unary messages (Prepare, Commit, Abort) are tiny; anything larger is refused by gRPC itself.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024
# Which data plane carries a transfer's bytes: "grpc" (the Push streams' messages), "shm" (a
# shared-memory segment, same host only; the transfer fails when it cannot be used) or "auto"
# (shared memory when the receiver can read the sender's segment and /dev/shm has room, gRPC
# otherwise). Control is gRPC on every plane.
DataPlaneName = Literal["auto", "grpc", "shm"]
DATA_PLANES: tuple[str, ...] = ("auto", "grpc", "shm")
# The checksum algorithms this side implements, by configuration name ("XXH3_64", "CRC32").
CHECKSUM_ALGORITHM_NAMES: dict[str, int] = {checksum_name(value): value for value in SUPPORTED_CHECKSUMS}


class TransferConfigError(ValueError):
    """An invalid configuration value (the message names the field)."""


class _TransferSection(ConfigStruct, frozen=True):
    """A section of the KV transfer configuration: its errors are TransferConfigErrors."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        if problem.kind is ProblemKind.UNKNOWN_KEY:
            owner = problem.owner or cls
            where = f"{problem.parent}: " if problem.parent else ""
            return TransferConfigError(
                f"{where}unknown {owner.__name__} field(s) {[problem.key]}; known: {sorted(owner.__struct_fields__)}"
            )
        if problem.kind is ProblemKind.RULE and not problem.path:
            return TransferConfigError(problem.detail)
        return TransferConfigError(f"{problem.path}: {problem.detail}")


class ReceiverConfig(_TransferSection, frozen=True):
    """The KV transfer server of a generation (or mixed) instance."""

    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    """Address the server binds."""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """TCP port; 0 picks a free port (KvTransferServer.port tells which)."""
    max_open_transfers: Annotated[int, Meta(ge=1, le=4096)] = 16
    """Open transfers beyond this are refused with RESOURCE_EXHAUSTED at Prepare."""
    max_streams_per_transfer: Annotated[int, Meta(ge=1, le=64)] = 4
    """Parallel Push streams accepted per transfer."""
    max_chunk_bytes: Annotated[int, Meta(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)] = 4 * MIB
    """Largest chunk payload accepted, in bytes; the gRPC message limit is this plus a small header allowance."""
    max_transfer_s: PositiveFloat = 120.0
    """Upper bound in seconds on any transfer's lifetime, whatever the sender asks for."""
    reaper_interval_s: PositiveFloat = 0.25
    """Seconds between sweeps that fail overdue transfers (DEADLINE_EXCEEDED) and release their targets."""
    finished_capacity: Annotated[int, Meta(ge=1, le=1 << 20)] = 4096
    """Finished transfer ids remembered, so late chunks are dropped quietly and retries answered."""
    stop_grace_s: PositiveFloat = 2.0
    """Seconds in-flight RPCs get to finish when the server stops."""
    data_plane: DataPlaneName = "auto"
    """"grpc" refuses senders' shared-memory offers; "auto" and "shm" accept them when this process
    can read the offered segment (worker/kv_transfer/shm.py)."""
    shm_max_mapped: Annotated[int, Meta(ge=1, le=256)] = 8
    """Senders' segments kept mapped between transfers (re-mapping one faults its pages in again)."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ReceiverConfig:
        return load_config(cls, data)

    @property
    def max_concurrent_rpcs(self) -> int:
        """Every stream of every open transfer, plus room for the unary calls."""
        return self.max_open_transfers * self.max_streams_per_transfer + 2 * self.max_open_transfers + 4


class SenderConfig(_TransferSection, frozen=True):
    """The KV sender of a prefill (or mixed) instance."""

    num_streams: Annotated[int, Meta(ge=1, le=64)] = 4
    """Parallel Push streams per transfer (fewer if the receiver allows fewer or there are fewer
    chunks). 4 over 4 connections: 1.04 of raw TCP on a 16-core host against 0.80 with 2 over 2 (the
    streams' copies run on separate cores); on 2 cores the same as 2 over 2 (bench/transfer_bench.py)."""
    num_connections: Annotated[int, Meta(ge=1, le=64)] = 4
    """Separate TCP connections per receiver; streams are spread over them."""
    max_chunk_bytes: Annotated[int, Meta(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)] = 4 * MIB
    """Largest chunk payload sent, in bytes."""
    abort_timeout_s: PositiveFloat = 1.0
    """Seconds allowed for the best-effort Abort sent after a failure."""
    checksum_algorithms: Annotated[tuple[str, ...], Meta(min_length=1)] = ("XXH3_64", "CRC32")
    """Checksum algorithms offered at Prepare, most preferred first (ChecksumAlgorithm names without
    their prefix). XXH3_64 is about 5x cheaper per byte than CRC32; CRC32 is what older receivers speak."""
    data_plane: DataPlaneName = "auto"
    """What carries the bytes: "auto" (shared memory when the receiver is on this host and /dev/shm has
    room, gRPC otherwise), "grpc", or "shm" (a transfer that cannot use shared memory fails INCOMPATIBLE)."""
    shm_pool_bytes: Annotated[int, Meta(ge=0)] = 512 * MIB
    """Idle shared-memory segments kept for reuse, in bytes (a fresh segment is pre-faulted once, at
    about a third of memcpy speed; a pooled one runs at memcpy speed)."""
    shm_max_segment_bytes: Annotated[int, Meta(ge=MIN_CHUNK_BYTES, le=1 << 34)] = 2048 * MIB
    """Largest segment one transfer may take; larger transfers go over gRPC (or fail under "shm")."""
    shm_min_free_bytes: Annotated[int, Meta(ge=0)] = 128 * MIB
    """Bytes /dev/shm must keep free after a new segment (Ray's object store lives there too);
    with less, "auto" falls back to gRPC."""

    def __post_init__(self) -> None:
        super().__post_init__()
        names = self.checksum_algorithms
        if len(set(names)) != len(names) or any(name not in CHECKSUM_ALGORITHM_NAMES for name in names):
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
        return load_config(cls, data)


class KvTransferConfig(_TransferSection, frozen=True):
    """The `kv_transfer:` section of the cluster configuration (its instances get the parts as
    plain data; host and port of the receiver are set per instance)."""

    bind_host: Annotated[str, Meta(min_length=1)] | None = None
    """Address every instance's KV transfer server binds. None: 127.0.0.1 in the embedded
    single-host cluster, each node's own address in a multi-host one (cluster/deploy/launch.py)."""
    tls: Literal["auto", "on", "off"] = "auto"
    """Mutual TLS between instances. auto: when the Ray cluster has more than one node (or was
    joined by address), or certificates are configured below; on a lone embedded node, plain TCP.
    on: always. off: plain TCP everywhere (logged as a warning when the cluster spans nodes). With
    no certificates configured, the deployer makes a per-deployment CA and issues every instance a
    certificate at deploy time, and a fresh one whenever the instance restarts."""
    tls_validity_days: Annotated[int, Meta(ge=1, le=3650)] = 365
    """Lifetime of the generated certificates, in days: longer than the deployment is expected to run."""
    tls_certificate_chain: Annotated[str, Meta(min_length=1)] | None = None
    """Your own certificates instead of generated ones: a PEM certificate chain file that every
    instance presents (as server and as client), read on the deploying machine at deploy time.
    Goes with tls_private_key and tls_root_certificates."""
    tls_private_key: Annotated[str, Meta(min_length=1)] | None = None
    """The PEM private key file of tls_certificate_chain."""
    tls_root_certificates: Annotated[str, Meta(min_length=1)] | None = None
    """PEM file of the CA(s) a peer's certificate must chain to."""
    tls_server_name: Annotated[str, Meta(min_length=1)] | None = None
    """The name senders verify in a receiver's certificate (a DNS name in its subjectAltName).
    None: the receiver's address, which must then be an IP address in the certificate."""
    sender: SenderConfig = SenderConfig()
    """Settings of every prefill (or mixed) instance's sender."""
    receiver: ReceiverConfig = ReceiverConfig()
    """Settings of every generation (or mixed) instance's transfer server."""
    data_plane: DataPlaneName | None = None
    """Sets `sender.data_plane` and `receiver.data_plane` of every instance at once (None: theirs)."""

    @property
    def tls_files(self) -> tuple[str, str, str] | None:
        """(certificate chain, private key, root certificates) when configured, else None."""
        files = (self.tls_certificate_chain, self.tls_private_key, self.tls_root_certificates)
        return None if files[0] is None else files  # type: ignore[return-value] - all or none (checked)

    def __post_init__(self) -> None:
        super().__post_init__()
        files = (self.tls_certificate_chain, self.tls_private_key, self.tls_root_certificates)
        if any(file is not None for file in files) and any(file is None for file in files):
            raise TransferConfigError("tls_certificate_chain, tls_private_key and tls_root_certificates go together")
        if self.tls == "off" and (files[0] is not None or self.tls_server_name is not None):
            raise TransferConfigError("tls is off, yet certificates are configured: drop one or the other")
        if self.tls_server_name is not None and files[0] is None:
            raise TransferConfigError("tls_server_name names the server in your own certificates: configure them too")
        if self.data_plane is not None:
            for side in (self.sender, self.receiver):
                if side.data_plane not in ("auto", self.data_plane):
                    raise TransferConfigError(
                        f"data_plane {self.data_plane!r} contradicts {type(side).__name__}.data_plane {side.data_plane!r}"
                    )


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
        # A peer that restarts is retried soon (100 ms, backing off to 2 s) ...
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # ... but each connection attempt gets this long: despite its name, gRPC core reads this
        # option as the minimum connect timeout (TCP connect, TLS handshake, HTTP/2 SETTINGS). At
        # 100 ms, mTLS handshakes on a loaded host timed out ("connection attempt timed out before
        # receiving SETTINGS frame"); a call's own deadline still bounds the wait.
        ("grpc.min_reconnect_backoff_ms", 10_000),
    ]
