"""Shared-memory segments of the KV transfer (worker/kv_transfer/shm.py): names, modes, pooling,
the receiver's checks on what it maps, copies out, sweeps; and the data-plane configuration."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from worker.config import load_config
from worker.kv_transfer import shm
from worker.kv_transfer.config import KvTransferConfig, ReceiverConfig, SenderConfig, TransferConfigError

MIB = 1 << 20


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    # A private directory stands in for /dev/shm: the same calls, nothing shared with other tests.
    return tmp_path


def test_segments_are_private_unguessable_and_sized_in_powers_of_two(directory: Path) -> None:
    pool = shm.SegmentPool(tag="t1", directory=directory, min_free_bytes=0)
    first, second = pool.acquire(3 * MIB), pool.acquire(100)
    for segment in (first, second):
        info = os.stat(directory / segment.name)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        assert segment.name.startswith(f"duet-kv-t1-{os.getpid()}-")
        assert len(segment.name.rsplit("-", 1)[1]) == 32  # 128 random bits
    assert (first.size_bytes, second.size_bytes) == (4 * MIB, shm.MIN_SEGMENT_BYTES)
    assert first.name != second.name
    pool.close()


def test_a_released_segment_is_reused_and_close_unlinks_everything(directory: Path) -> None:
    pool = shm.SegmentPool(tag="t2", directory=directory, min_free_bytes=0)
    segment = pool.acquire(2 * MIB)
    pool.release(segment)
    again = pool.acquire(2 * MIB)
    assert again is segment
    busy = pool.acquire(2 * MIB)  # the first is taken: a second one is made
    assert busy is not segment
    assert pool.stats() == shm.PoolStats(created=2, reused=1, idle=0, in_use=2)
    pool.release(again)
    pool.close()
    assert shm.segments("t2", directory) == [busy.name]  # in use: unlinked when given back
    pool.release(busy)
    assert shm.segments("t2", directory) == []


def test_idle_segments_beyond_the_pool_limit_are_unlinked(directory: Path) -> None:
    pool = shm.SegmentPool(tag="t3", directory=directory, min_free_bytes=0, max_idle_bytes=2 * MIB)
    segments = [pool.acquire(2 * MIB) for _ in range(3)]
    for segment in segments:
        pool.release(segment)
    assert len(shm.segments("t3", directory)) == 1
    pool.close()


def test_a_full_directory_or_a_too_large_transfer_is_refused_not_faulted(directory: Path) -> None:
    full = shm.SegmentPool(tag="t4", directory=directory, min_free_bytes=1 << 60)
    with pytest.raises(shm.ShmError, match="free"):
        full.acquire(MIB)
    small = shm.SegmentPool(tag="t4", directory=directory, min_free_bytes=0, max_segment_bytes=4 * MIB)
    with pytest.raises(shm.ShmError, match="exceeds"):
        small.acquire(5 * MIB)
    assert shm.segments("t4", directory) == []


def test_the_reader_copies_out_what_the_owner_wrote(directory: Path) -> None:
    pool = shm.SegmentPool(tag="t5", directory=directory, min_free_bytes=0)
    segment = pool.acquire(MIB)
    segment.write(100, (b"abc", memoryview(b"defg")))
    reader = shm.SegmentReader(directory=directory)
    mapped = reader.open(segment.name)
    copy = shm.copy_out(mapped, 100, 7)
    segment.write(100, (b"XXXXXXX",))  # the owner writes on: the copy is private
    assert bytes(copy) == b"abcdefg"
    with pytest.raises(shm.ShmError, match="outside"):
        shm.copy_out(mapped, MIB - 3, 7)
    pool.release(segment)
    pool.close()
    # The mapping of a segment its owner unlinked is dropped at the next open (it would pin memory).
    other = shm.SegmentPool(tag="t5", directory=directory, min_free_bytes=0).acquire(MIB)
    reader.open(other.name)
    assert segment.name not in reader._mapped


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "duet-kv-x-1-short", "duet-kv-X-1-" + "0" * 32, "other-file", "duet-kv-a-1-" + "0" * 32 + "/x"],
)
def test_the_reader_refuses_names_that_are_not_segment_names(directory: Path, name: str) -> None:
    with pytest.raises(shm.ShmError, match="not a segment name"):
        shm.SegmentReader(directory=directory).open(name)


def test_the_reader_refuses_files_others_can_read_and_links(directory: Path) -> None:
    name = "duet-kv-t6-1-" + "a" * 32
    path = directory / name
    path.write_bytes(bytes(MIB))
    os.chmod(path, 0o644)
    with pytest.raises(shm.ShmError, match="private regular file"):
        shm.SegmentReader(directory=directory).open(name)
    target = directory / "target"
    target.write_bytes(bytes(MIB))
    os.chmod(target, 0o600)
    link = "duet-kv-t6-1-" + "b" * 32
    (directory / link).symlink_to(target)
    with pytest.raises(shm.ShmError, match="cannot open"):
        shm.SegmentReader(directory=directory).open(link)


def test_sweep_removes_a_tag_and_spares_live_owners_when_asked(directory: Path) -> None:
    live = shm.SegmentPool(tag="t7", directory=directory, min_free_bytes=0).acquire(MIB)
    dead_name = f"duet-kv-t7-{2**22 + 12345}-" + "c" * 32  # above the default pid_max: never alive
    (directory / dead_name).write_bytes(b"")
    foreign = "duet-kv-t8-1-" + "d" * 32
    (directory / foreign).write_bytes(b"")
    assert shm.sweep("t7", directory, only_dead_owners=True) == [dead_name]
    assert shm.segments("t7", directory) == [live.name]
    assert shm.sweep_when_owners_exit("t7", wait_s=0.1, directory=directory) == [live.name]
    assert shm.segments(None, directory) == [foreign]


def test_a_new_pool_sweeps_its_tags_segments_of_dead_owners(directory: Path) -> None:
    dead_name = f"duet-kv-t9-{2**22 + 54321}-" + "e" * 32
    (directory / dead_name).write_bytes(b"")
    shm.SegmentPool(tag="t9", directory=directory)
    assert shm.segments("t9", directory) == []


def test_tags_are_checked() -> None:
    with pytest.raises(ValueError, match="tag"):
        shm.SegmentPool(tag="Bad-Tag")


def test_data_plane_configuration() -> None:
    assert SenderConfig().data_plane == ReceiverConfig().data_plane == "auto"
    with pytest.raises(TransferConfigError, match="data_plane"):
        SenderConfig.from_mapping({"data_plane": "rdma"})
    assert load_config(KvTransferConfig, {"data_plane": "shm"}).data_plane == "shm"
    with pytest.raises(TransferConfigError, match="contradicts"):
        load_config(KvTransferConfig, {"data_plane": "shm", "sender": {"data_plane": "grpc"}})
