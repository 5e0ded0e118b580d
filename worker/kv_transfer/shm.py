"""Shared-memory segments of the KV transfer's shared-memory data plane (one host).

The sender owns the segments: a pool of files in the host's shared-memory directory (/dev/shm),
each created O_EXCL with mode 0600 under an unguessable name
`duet-kv-<cluster tag>-<owner pid>-<32 hex digits>`, allocated with posix_fallocate (a full
/dev/shm is ENOSPC here, not SIGBUS at the first write) and mapped with MAP_POPULATE: a fresh
segment's first touch runs at a fraction of memcpy speed (page faults, zeroing), so segments are
pre-faulted once and reused. A push takes one segment for its whole transfer, writes each chunk at
its offset, and gives it back after the push has returned and no stream thread is writing.

The receiver maps a sender's segment read-only by name (checking that it is a regular file of
this user, readable by nobody else), keeps a few mappings (a re-mapped segment is faulted again),
copies each chunk out into private memory and verifies the checksum on that copy: the sender could
still write the segment. Mappings of segments that are gone from the directory are dropped.

Nothing is left behind: a sender unlinks its segments when it closes; after a SIGKILL the owner's
segments stay until `sweep` removes them (the launcher sweeps its cluster's tag when the cluster
stops; a new pool sweeps its tag's segments whose owner process is dead). A killed receiver holds
only mappings, which the kernel drops with the process.

Trust: only processes of the cluster's user can open a segment (0600, and the receiver refuses a
file that is not its user's private regular file), and a name alone, guessed or not, grants nothing
to anyone else. A process of that same user that truncated a segment while a receiver copies from
it would crash the receiver with SIGBUS (such a process can also kill it outright, so this adds no
privilege, but a bug could do it); a memfd sealed against shrinking (F_SEAL_SHRINK) and passed as a
file descriptor would close that gap, at the price of a unix-socket hand-off per segment.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SHM_DIRECTORY = Path("/dev/shm")
NAME_PREFIX = "duet-kv-"
PROBE_BYTES = 16
MIB = 1 << 20
# Segments come in powers of two from this size up, so that a pooled one fits many transfers.
MIN_SEGMENT_BYTES = 1 * MIB
# The largest segment a receiver maps (a sender's bigger transfers go over gRPC).
MAX_SEGMENT_BYTES = 1 << 34
_TAG = r"[0-9a-z]{1,16}"
_TAG_RE = re.compile(_TAG)
_NAME_RE = re.compile(rf"{NAME_PREFIX}({_TAG})-([0-9]{{1,10}})-[0-9a-f]{{32}}")


class ShmError(RuntimeError):
    """A segment cannot be created, opened or read (the transfer falls back or fails)."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or _TAG_RE.fullmatch(tag) is None:
        raise ValueError(f"a shared-memory tag is 1-16 characters of [0-9a-z], got {tag!r}")
    return tag


def segment_size_for(size_bytes: int) -> int:
    """The pooled size class of a transfer of `size_bytes`: the next power of two, at least 1 MiB."""
    return max(MIN_SEGMENT_BYTES, 1 << max(size_bytes - 1, 0).bit_length())


def free_bytes(directory: Path = SHM_DIRECTORY) -> int:
    """Bytes an unprivileged user may still allocate in `directory` (0 when it is not there)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class Segment:
    """One sender-owned segment, created, pre-faulted and mapped read-write."""

    def __init__(self, name: str, path: Path, size_bytes: int, mapping: mmap.mmap) -> None:
        self.name = name
        self.path = path
        self.size_bytes = size_bytes
        self._mapping = mapping
        # numpy copies release the GIL (a memoryview slice assignment holds it), so the streams of
        # a push and gRPC's own threads copy in parallel.
        self.array = np.frombuffer(mapping, dtype=np.uint8)

    @classmethod
    def create(cls, directory: Path, tag: str, size_bytes: int) -> Segment:
        name = f"{NAME_PREFIX}{check_tag(tag)}-{os.getpid()}-{secrets.token_hex(16)}"
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise ShmError(f"cannot create {path}: {error}") from error
        try:
            os.posix_fallocate(fd, 0, size_bytes)
            mapping = mmap.mmap(
                fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError as error:
            path.unlink(missing_ok=True)
            raise ShmError(f"cannot allocate {size_bytes} bytes in {directory}: {error}") from error
        finally:
            os.close(fd)
        return cls(name, path, size_bytes, mapping)

    def write(self, offset: int, parts: tuple[memoryview | bytes | bytearray, ...] | list) -> int:
        """Copy `parts` one after another from `offset`; returns the bytes written."""
        position = offset
        for part in parts:
            source = np.frombuffer(part, dtype=np.uint8)
            end = position + source.size
            if end > self.size_bytes:
                raise ShmError(f"write of [{offset}, {end}) outside segment {self.name} of {self.size_bytes} bytes")
            np.copyto(self.array[position:end], source)
            position = end
        return position - offset

    def close(self) -> None:
        """Unlink and unmap (mappings a receiver still holds stay valid until it drops them)."""
        self.path.unlink(missing_ok=True)
        del self.array
        try:
            self._mapping.close()
        except BufferError:  # a view is still exported (a stream thread mid-copy): the GC unmaps
            logger.debug("segment %s still has views; left to the garbage collector", self.name)


@dataclass(frozen=True)
class PoolStats:
    created: int
    reused: int
    idle: int
    in_use: int


class SegmentPool:
    """The sender's segments: taken for one push each, kept (up to `max_idle_bytes`) for the next.
    Thread-safe."""

    def __init__(
        self,
        *,
        tag: str = "0",
        directory: Path = SHM_DIRECTORY,
        max_idle_bytes: int = 512 * MIB,
        max_segment_bytes: int = 2048 * MIB,
        min_free_bytes: int = 128 * MIB,
    ) -> None:
        self.tag = check_tag(tag)
        self.directory = directory
        self._max_idle_bytes = max_idle_bytes
        self._max_segment_bytes = max_segment_bytes
        self._min_free_bytes = min_free_bytes
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._in_use: set[Segment] = set()
        self._created = self._reused = 0
        self._closed = False
        # A predecessor of this process that was SIGKILLed (a restarted instance) left its segments.
        sweep(tag, directory, only_dead_owners=True)

    def acquire(self, size_bytes: int) -> Segment:
        """A segment of at least `size_bytes` for one push; ShmError when shared memory cannot
        hold it (too large, or the directory would keep less than `min_free_bytes` free)."""
        size_class = segment_size_for(size_bytes)
        if size_class > self._max_segment_bytes:
            raise ShmError(f"a transfer of {size_bytes} bytes exceeds shm_max_segment_bytes ({self._max_segment_bytes})")
        with self._lock:
            if self._closed:
                raise ShmError("the segment pool is closed")
            fitting = [segment for segment in self._idle if segment.size_bytes == size_class]
            if fitting:
                segment = fitting[0]
                self._idle.remove(segment)
                self._in_use.add(segment)
                self._reused += 1
                return segment
        available = free_bytes(self.directory)
        if available < size_class + self._min_free_bytes:
            # Ray's object store and container limits make a small /dev/shm common.
            self._trim(0)  # idle segments of other sizes may be what fills it
            available = free_bytes(self.directory)
            if available < size_class + self._min_free_bytes:
                raise ShmError(
                    f"{self.directory} has {available} bytes free; a {size_class}-byte segment must leave "
                    f"{self._min_free_bytes}"
                )
        segment = Segment.create(self.directory, self.tag, size_class)
        with self._lock:
            if self._closed:
                segment.close()
                raise ShmError("the segment pool is closed")
            self._in_use.add(segment)
            self._created += 1
        return segment

    def release(self, segment: Segment) -> None:
        """Give a segment back (no one writes it any more)."""
        with self._lock:
            self._in_use.discard(segment)
            if self._closed:
                close = True
            else:
                self._idle.append(segment)
                close = False
        if close:
            segment.close()
        else:
            self._trim(self._max_idle_bytes)

    def _trim(self, max_idle_bytes: int) -> None:
        closing = []
        with self._lock:
            while self._idle and sum(segment.size_bytes for segment in self._idle) > max_idle_bytes:
                closing.append(self._idle.pop(0))  # the least recently released first
        for segment in closing:
            segment.close()

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._created, self._reused, len(self._idle), len(self._in_use))

    def close(self) -> None:
        """Unlink every segment (those in use when their push gives them back)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for segment in idle:
            segment.close()


class _Mapping:
    def __init__(self, name: str, size_bytes: int, mapping: mmap.mmap) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.mapping = mapping
        self.array = np.frombuffer(mapping, dtype=np.uint8)


class SegmentReader:
    """The receiver's read-only mappings of senders' segments, by name. Thread-safe."""

    def __init__(self, *, directory: Path = SHM_DIRECTORY, max_mapped: int = 8) -> None:
        self.directory = directory
        self._max_mapped = max_mapped
        self._lock = threading.Lock()
        self._mapped: OrderedDict[str, _Mapping] = OrderedDict()

    def open(self, name: str) -> _Mapping:
        """The mapping of segment `name`; ShmError if the name is not a segment's, or the file is
        not this user's private regular file of a plausible size."""
        if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
            raise ShmError(f"not a segment name: {name[:80]!r}")
        self._drop_gone()
        with self._lock:
            mapped = self._mapped.get(name)
            if mapped is not None:
                self._mapped.move_to_end(name)
                return mapped
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise ShmError(f"cannot open {path}: {os.strerror(error.errno or errno.EIO)}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise ShmError(f"{path} is not a private regular file of this user")
            if not MIN_SEGMENT_BYTES <= info.st_size <= MAX_SEGMENT_BYTES:
                raise ShmError(f"{path} has an implausible size of {info.st_size} bytes")
            mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except OSError as error:
            raise ShmError(f"cannot map {path}: {error}") from None
        finally:
            os.close(fd)
        mapped = _Mapping(name, info.st_size, mapping)
        evicted = []
        with self._lock:
            self._mapped[name] = mapped
            while len(self._mapped) > self._max_mapped:
                evicted.append(self._mapped.popitem(last=False)[1])
        del evicted  # unmapped when the last copy out of them ends
        return mapped

    def _drop_gone(self) -> None:
        """Forget mappings of segments their sender has unlinked (they would pin its memory)."""
        with self._lock:
            names = list(self._mapped)
        gone = [name for name in names if not (self.directory / name).exists()]
        if gone:
            with self._lock:
                for name in gone:
                    self._mapped.pop(name, None)

    def close(self) -> None:
        with self._lock:
            self._mapped.clear()


class ScratchBuffers:
    """One reusable buffer per thread for copies out of segments: a fresh allocation per chunk would
    be faulted in page by page, at a fraction of memcpy speed, on every chunk."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, length: int) -> np.ndarray:
        buffer: np.ndarray | None = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < length:
            buffer = np.ones(length, dtype=np.uint8)  # written once here: faulted in now, not per chunk
            self._local.buffer = buffer
        return buffer[:length]


def copy_out(mapped: _Mapping, offset: int, length: int, into: np.ndarray | None = None) -> memoryview:
    """A private copy of [offset, offset + length) of a mapped segment, in `into` (exactly `length`
    bytes) or a new buffer; the copy releases the GIL."""
    if offset < 0 or length < 0 or offset + length > mapped.size_bytes:
        raise ShmError(f"range [{offset}, {offset + length}) outside segment {mapped.name} of {mapped.size_bytes} bytes")
    copy = np.empty(length, dtype=np.uint8) if into is None else into
    np.copyto(copy, mapped.array[offset : offset + length])
    return memoryview(copy).cast("B")


def copy_into(mapped: _Mapping, offset: int, views: Sequence[memoryview]) -> int:
    """Copy the segment's bytes from `offset` into `views` one after another (GIL released);
    returns the bytes copied."""
    position = offset
    for view in views:
        destination = np.frombuffer(view, dtype=np.uint8)
        end = position + destination.size
        if end > mapped.size_bytes:
            raise ShmError(f"range [{offset}, {end}) outside segment {mapped.name} of {mapped.size_bytes} bytes")
        np.copyto(destination, mapped.array[position:end])
        position = end
    return position - offset


def segments(tag: str | None = None, directory: Path = SHM_DIRECTORY) -> list[str]:
    """Names of duet segments in `directory` (of one cluster tag, or all)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _NAME_RE.fullmatch(name)
        if match is not None and (tag is None or match.group(1) == tag):
            found.append(name)
    return sorted(found)


def sweep(tag: str, directory: Path = SHM_DIRECTORY, *, only_dead_owners: bool = False) -> list[str]:
    """Unlink this user's segments of cluster `tag` (only those whose owner process is gone, when
    `only_dead_owners`); returns their names. Owner pids are in the names, and are judged in this
    process's pid namespace: where another namespace shares the directory, a live owner looks dead."""
    check_tag(tag)
    removed = []
    uid = os.geteuid()
    for name in segments(tag, directory):
        match = _NAME_RE.fullmatch(name)
        assert match is not None
        owner = int(match.group(2))
        if only_dead_owners and (owner == os.getpid() or _pid_alive(owner)):
            continue
        path = directory / name
        try:
            if os.lstat(path).st_uid != uid:
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            logger.warning("cannot remove shared-memory segment %s: %s", path, error)
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d shared-memory segment(s) of tag %s", len(removed), tag)
    return removed


def sweep_when_owners_exit(tag: str, wait_s: float, directory: Path = SHM_DIRECTORY) -> list[str]:
    """Wait (at most `wait_s`) until no owner of a `tag` segment is alive, then sweep them all: what
    a launcher does after killing its instances (a kill returns before the process is gone, and a
    live owner could still create a segment after the sweep)."""
    deadline_s = time.monotonic() + wait_s
    while live_owners(tag, directory) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    return sweep(tag, directory)


def owners(tag: str, directory: Path = SHM_DIRECTORY) -> set[int]:
    """The pids that own segments of `tag`."""
    return {int(match.group(2)) for name in segments(tag, directory) if (match := _NAME_RE.fullmatch(name))}


def live_owners(tag: str, directory: Path = SHM_DIRECTORY) -> set[int]:
    return {pid for pid in owners(tag, directory) if _pid_alive(pid)}
