"""Load snapshots that every instance sends the router, and their msgpack wire form.

A snapshot is what placement sees of an instance: its role, its KV block pool, its queue, and the
prefix-cache events (block hashes stored / removed) since its previous snapshot. Snapshots cross a
process boundary, so the wire form is msgpack (never pickle), bounded in size, carries a schema
version, and is validated field by field on decode: a malformed snapshot raises a typed error and
never reaches placement.

Sequence numbers are per instance incarnation and increase by one per snapshot; `reset` marks the
first snapshot of a new incarnation (a restarted instance, or one that dropped its prefix cache),
meaning "forget everything you know about me". The prefix index (cluster/prefix_index.py) relies on
both to stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from worker.engine_types import InstanceRole

SCHEMA_VERSION = 1
# A snapshot is a few hundred bytes plus 9 bytes per prefix event hash; 4 MiB leaves room for a
# burst of ~400k hash events while bounding what one peer can make the router allocate.
DEFAULT_MAX_SNAPSHOT_BYTES = 4 * 1024 * 1024
MAX_INSTANCE_ID_CHARS = 128
# Counters travel as msgpack integers; bounding them by int64 keeps every peer's decoder happy.
MAX_COUNTER = 2**63 - 1
# scheduler/block_hash.py makes 8-byte hashes read as unsigned little-endian integers.
MAX_BLOCK_HASH = 2**64 - 1


class SnapshotError(ValueError):
    """Base of every error raised while building, encoding or decoding a snapshot."""


class InvalidSnapshot(SnapshotError):
    """A snapshot field is missing, unknown, of the wrong type, or out of range."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"snapshot field {field!r}: {message}")


class UnsupportedSchemaVersion(InvalidSnapshot):
    """The snapshot was written with a schema version this router does not read."""


class SnapshotTooLarge(SnapshotError):
    """An encoded snapshot exceeds the configured size limit."""

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__(f"snapshot is {size_bytes} bytes, limit is {limit_bytes} bytes")


class PrefixEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


def _check_counter(field: str, value: object, minimum: int = 0) -> None:
    # bool is an int subclass; a True where a count belongs is a producer bug, not a 1.
    if type(value) is not int:
        raise InvalidSnapshot(field, f"expected an integer, got {type(value).__name__}")
    if not minimum <= value <= MAX_COUNTER:
        raise InvalidSnapshot(field, f"{value} is outside [{minimum}, {MAX_COUNTER}]")


@dataclass(frozen=True)
class PrefixEvent:
    """Full KV blocks (by scheduler/block_hash.py hash) an instance added to or evicted from its cache."""

    kind: PrefixEventKind
    block_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, PrefixEventKind):
            raise InvalidSnapshot("prefix_events.kind", f"expected a PrefixEventKind, got {self.kind!r}")
        if not isinstance(self.block_hashes, tuple):
            raise InvalidSnapshot("prefix_events.block_hashes", "expected a tuple of block hashes")
        if not self.block_hashes:
            raise InvalidSnapshot("prefix_events.block_hashes", "an event must name at least one block")
        for block_hash in self.block_hashes:
            if type(block_hash) is not int or not 0 <= block_hash <= MAX_BLOCK_HASH:
                raise InvalidSnapshot(
                    "prefix_events.block_hashes", f"{block_hash!r} is not an unsigned 64-bit block hash"
                )


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load as of `timestamp_s` (the instance's clock), the `sequence`-th of its incarnation.

    Block counts are in the instance's KV pool; cached-but-unreferenced prefix blocks count as free.
    `queued_prompt_tokens` is the prompt demand of requests not yet admitted by the capacity scheduler;
    `tokens_in_flight` is prompt plus generated tokens of the running requests.
    """

    instance_id: str
    role: InstanceRole
    sequence: int
    timestamp_s: float
    total_blocks: int
    free_blocks: int
    tokens_per_block: int
    queued_requests: int
    running_requests: int
    queued_prompt_tokens: int
    tokens_in_flight: int
    num_paused: int
    prefix_events: tuple[PrefixEvent, ...] = ()
    reset: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise InvalidSnapshot("instance_id", "expected a non-empty string")
        if len(self.instance_id) > MAX_INSTANCE_ID_CHARS or not self.instance_id.isprintable():
            raise InvalidSnapshot(
                "instance_id", f"must be printable and at most {MAX_INSTANCE_ID_CHARS} characters"
            )
        if not isinstance(self.role, InstanceRole):
            raise InvalidSnapshot("role", f"expected an InstanceRole, got {self.role!r}")
        _check_counter("sequence", self.sequence)
        if type(self.timestamp_s) is not float or not math.isfinite(self.timestamp_s) or self.timestamp_s < 0:
            raise InvalidSnapshot("timestamp_s", f"expected a finite float >= 0, got {self.timestamp_s!r}")
        _check_counter("total_blocks", self.total_blocks, minimum=1)
        _check_counter("free_blocks", self.free_blocks)
        if self.free_blocks > self.total_blocks:
            raise InvalidSnapshot(
                "free_blocks", f"{self.free_blocks} exceeds total_blocks {self.total_blocks}"
            )
        _check_counter("tokens_per_block", self.tokens_per_block, minimum=1)
        for name in (
            "queued_requests",
            "running_requests",
            "queued_prompt_tokens",
            "tokens_in_flight",
            "num_paused",
        ):
            _check_counter(name, getattr(self, name))
        if not isinstance(self.prefix_events, tuple):
            raise InvalidSnapshot("prefix_events", "expected a tuple of PrefixEvent")
        for event in self.prefix_events:
            if not isinstance(event, PrefixEvent):
                raise InvalidSnapshot("prefix_events", f"expected PrefixEvent, got {type(event).__name__}")
        if type(self.reset) is not bool:
            raise InvalidSnapshot("reset", f"expected a bool, got {type(self.reset).__name__}")

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def queued_prompt_blocks(self) -> int:
        """Blocks the queued-but-not-admitted prompts will need (rounded up)."""
        return -(-self.queued_prompt_tokens // self.tokens_per_block)


# Wire keys, in encoding order; decode rejects anything else.
_INT_FIELDS = (
    "sequence",
    "total_blocks",
    "free_blocks",
    "tokens_per_block",
    "queued_requests",
    "running_requests",
    "queued_prompt_tokens",
    "tokens_in_flight",
    "num_paused",
)
_TOP_KEYS = frozenset(
    ("schema_version", "instance_id", "role", "timestamp_s", "prefix_events", "reset") + _INT_FIELDS
)
_EVENT_KEYS = frozenset(("kind", "block_hashes"))


def encode(load: InstanceLoad, *, max_size_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> bytes:
    """The msgpack bytes of `load`; raises SnapshotTooLarge beyond `max_size_bytes`."""
    if not isinstance(load, InstanceLoad):
        raise TypeError(f"encode expects an InstanceLoad, got {type(load).__name__}")
    body: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "instance_id": load.instance_id,
        "role": load.role.value,
        "timestamp_s": load.timestamp_s,
    }
    for name in _INT_FIELDS:
        body[name] = getattr(load, name)
    body["prefix_events"] = [
        {"kind": event.kind.value, "block_hashes": list(event.block_hashes)} for event in load.prefix_events
    ]
    body["reset"] = load.reset
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > max_size_bytes:
        raise SnapshotTooLarge(len(data), max_size_bytes)
    return data


def _reject_ext(code: int, data: bytes) -> object:
    raise InvalidSnapshot("<message>", f"msgpack extension type {code} is not allowed")


def decode(data: bytes, *, max_size_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES) -> InstanceLoad:
    """Parse and validate snapshot bytes from an instance; every defect raises a SnapshotError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidSnapshot("<message>", f"expected bytes, got {type(data).__name__}")
    size_bytes = memoryview(data).nbytes
    if size_bytes > max_size_bytes:
        raise SnapshotTooLarge(size_bytes, max_size_bytes)
    try:
        # unpackb caps every str/bin/array/map length by the input size, which is bounded above.
        raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext)
    except InvalidSnapshot:
        raise
    except ValueError as err:
        # msgpack reports truncation, trailing bytes, bad UTF-8, over-deep nesting and non-string map
        # keys as ValueError subclasses.
        raise InvalidSnapshot("<message>", f"not a valid msgpack document: {err}") from err
    return _from_wire(raw)


def _from_wire(raw: object) -> InstanceLoad:
    if not isinstance(raw, dict):
        raise InvalidSnapshot("<message>", f"expected a map at the top level, got {type(raw).__name__}")
    version = raw.get("schema_version")
    if type(version) is not int:
        raise InvalidSnapshot("schema_version", "missing or not an integer")
    if version != SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            "schema_version", f"{version} is not supported (this reads {SCHEMA_VERSION})"
        )
    _check_keys(raw, _TOP_KEYS, prefix="")

    role_name = raw["role"]
    if not isinstance(role_name, str):
        raise InvalidSnapshot("role", f"expected a string, got {type(role_name).__name__}")
    try:
        role = InstanceRole(role_name)
    except ValueError:
        raise InvalidSnapshot(
            "role", f"{role_name!r} is not one of {[r.value for r in InstanceRole]}"
        ) from None

    timestamp = raw["timestamp_s"]
    # Integers are accepted for the timestamp (a whole-second clock is legitimate); bool is not.
    if type(timestamp) is int:
        timestamp = float(timestamp)

    events_raw = raw["prefix_events"]
    if not isinstance(events_raw, list):
        raise InvalidSnapshot("prefix_events", f"expected an array, got {type(events_raw).__name__}")
    events = tuple(_event_from_wire(item, index) for index, item in enumerate(events_raw))

    # Type checks of the remaining scalars happen in InstanceLoad.__post_init__, with the field name.
    return InstanceLoad(
        instance_id=raw["instance_id"],
        role=role,
        timestamp_s=timestamp,
        prefix_events=events,
        reset=raw["reset"],
        **{name: raw[name] for name in _INT_FIELDS},
    )


def _event_from_wire(item: object, index: int) -> PrefixEvent:
    where = f"prefix_events[{index}]"
    if not isinstance(item, dict):
        raise InvalidSnapshot(where, f"expected a map, got {type(item).__name__}")
    _check_keys(item, _EVENT_KEYS, prefix=where + ".")
    kind_name = item["kind"]
    if not isinstance(kind_name, str):
        raise InvalidSnapshot(where + ".kind", "expected a string")
    try:
        kind = PrefixEventKind(kind_name)
    except ValueError:
        raise InvalidSnapshot(where + ".kind", f"{kind_name!r} is not a prefix event kind") from None
    hashes = item["block_hashes"]
    if not isinstance(hashes, list):
        raise InvalidSnapshot(where + ".block_hashes", f"expected an array, got {type(hashes).__name__}")
    try:
        return PrefixEvent(kind=kind, block_hashes=tuple(hashes))
    except InvalidSnapshot as err:
        raise InvalidSnapshot(where + ".block_hashes", err.detail) from None


def _check_keys(raw: Mapping[object, object], expected: frozenset[str], prefix: str) -> None:
    for key in raw:
        if key not in expected:
            raise InvalidSnapshot(f"{prefix}{key}", "unknown key")
    missing = sorted(expected - raw.keys())
    if missing:
        raise InvalidSnapshot(f"{prefix}{missing[0]}", "missing")
