"""PagedKvCache: layout, export/import byte round trips (fp32 and bf16), validation."""

from __future__ import annotations

import pytest
import torch

from worker.kv_cache import KvCacheError, PagedKvCache
from worker.kv_layout import KvLayout


def make_cache(dtype: str, num_blocks: int = 10, seed: int = 0) -> PagedKvCache:
    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, tokens_per_block=5, dtype=dtype, model_fingerprint="f")
    cache = PagedKvCache(layout, num_blocks)
    generator = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=generator).to(cache.dtype))
    return cache


def test_tensor_shape_follows_the_layout():
    cache = make_cache("float32")
    assert cache.tensor.shape == (3, 2, 10, 5, 2, 4)
    assert cache.num_blocks == 10
    assert cache.layout.block_bytes_per_layer == 2 * 5 * 2 * 4 * 4
    k, v = cache.layer_slots(1)
    assert k.shape == (50, 2, 4)
    assert k.data_ptr() == cache.tensor[1, 0].data_ptr()
    assert v.data_ptr() == cache.tensor[1, 1].data_ptr()


def test_a_fresh_cache_is_zeroed():
    layout = KvLayout(1, 1, 2, 2, "float32", "f")
    assert PagedKvCache(layout, 3).tensor.abs().sum() == 0


def test_export_is_exactly_the_layout_bytes():
    cache = make_cache("float32")
    blocks = [7, 2, 5]
    exported = cache.export_blocks(blocks, 1, 3)
    assert exported.shape == (2, 2, 3, 5, 2, 4)
    assert exported.is_contiguous()
    assert torch.equal(exported, cache.tensor[1:3, :, blocks])
    data = cache.export_bytes(blocks, 1, 3)
    assert len(data) == cache.layout.run_bytes(2, 3)
    assert data == cache.tensor[1:3, :, blocks].contiguous().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_between_caches_is_bit_exact(dtype):
    source = make_cache(dtype, seed=1)
    target = make_cache(dtype, seed=2)
    before = target.tensor.clone()
    src_blocks, dst_blocks = [1, 8, 3], [9, 0, 4]
    data = source.export_bytes(src_blocks, 0, 2)
    target.import_blocks(dst_blocks, 0, 2, data)
    assert torch.equal(target.tensor[0:2, :, dst_blocks].view(torch.uint8), source.tensor[0:2, :, src_blocks].view(torch.uint8))
    # Nothing else changed: other layers and other blocks keep their bytes.
    assert torch.equal(target.tensor[2], before[2])
    untouched = [b for b in range(10) if b not in dst_blocks]
    assert torch.equal(target.tensor[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "uint8_tensor", "typed_tensor"])
def test_import_accepts_every_buffer_kind(kind):
    source = make_cache("bfloat16", seed=3)
    target = make_cache("bfloat16", seed=4)
    raw = source.export_uint8([2, 6], 1, 2)
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    data = {
        "bytes": raw.numpy().tobytes(),
        "bytearray": bytearray(raw.numpy().tobytes()),
        "memoryview": memoryview(raw.numpy().tobytes()),
        "uint8_tensor": raw,
        "typed_tensor": source.export_blocks([2, 6], 1, 2),
    }[kind]
    target.import_blocks([5, 1], 1, 2, data)
    assert torch.equal(target.tensor[1:2, :, [5, 1]].view(torch.uint8), source.tensor[1:2, :, [2, 6]].view(torch.uint8))


def test_import_validates_byte_length():
    cache = make_cache("float32")
    data = cache.export_bytes([1, 2], 0, 3)
    with pytest.raises(KvCacheError, match="bytes"):
        cache.import_blocks([1], 0, 3, data)
    with pytest.raises(KvCacheError, match="bytes"):
        cache.import_blocks([1, 2], 0, 3, data[:-1])
    with pytest.raises(KvCacheError, match="bytes"):
        cache.import_blocks([1, 2], 0, 2, data)
    with pytest.raises(KvCacheError, match="dtype"):
        cache.import_blocks([1, 2], 0, 3, torch.zeros(len(data) // 8, dtype=torch.float64))


def test_a_bf16_run_is_not_accepted_by_an_fp32_cache_of_the_same_shape():
    bf16 = make_cache("bfloat16")
    fp32 = make_cache("float32")
    with pytest.raises(KvCacheError, match="bytes"):
        fp32.import_blocks([0, 1], 0, 3, bf16.export_bytes([0, 1], 0, 3))


@pytest.mark.parametrize(
    "blocks, layers, message",
    [
        ([], (0, 1), "empty"),
        ([10], (0, 1), "outside"),
        ([-1], (0, 1), "outside"),
        ([1, 1], (0, 1), "distinct"),
        ([1], (1, 1), "layer range"),
        ([1], (0, 4), "layer range"),
        ([1], (-1, 1), "layer range"),
    ],
)
def test_import_validates_ids_and_layers(blocks, layers, message):
    cache = make_cache("float32")
    data = b"\0" * cache.layout.run_bytes(max(layers[1] - layers[0], 1), max(len(blocks), 1))
    with pytest.raises(KvCacheError, match=message):
        cache.import_blocks(blocks, layers[0], layers[1], data)


def test_export_validates_ids_and_layers():
    cache = make_cache("float32")
    with pytest.raises(KvCacheError, match="outside"):
        cache.export_blocks([11], 0, 1)
    with pytest.raises(KvCacheError, match="layer range"):
        cache.export_blocks([1], 2, 1)
    # Exporting a block twice is well defined (the same bytes twice).
    twice = cache.export_blocks([4, 4], 0, 1)
    assert torch.equal(twice[:, :, 0], twice[:, :, 1])


def test_num_blocks_must_be_positive():
    layout = KvLayout(1, 1, 2, 2, "float32", "f")
    with pytest.raises(KvCacheError, match="num_blocks"):
        PagedKvCache(layout, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "ids",
    [[3, 4, 5, 6], [9, 2, 3, 4], [1, 3, 5, 7, 9, 11], [7]],
    ids=["one run", "two runs", "six runs (the indexed path)", "one block"],
)
def test_import_by_runs_writes_what_the_indexed_import_writes(dtype, ids):
    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=dtype, model_fingerprint="m")
    source = PagedKvCache(layout, 16)
    source.tensor.copy_(torch.randn(source.tensor.shape).to(source.dtype))
    data = source.export_bytes(list(range(len(ids))), 1, 3)
    by_runs, indexed = PagedKvCache(layout, 16), PagedKvCache(layout, 16)
    by_runs.import_blocks(ids, 1, 3, data)  # bytes: the run-by-run copy when the ids make few runs
    indexed.import_blocks(ids, 1, 3, torch.frombuffer(bytearray(data), dtype=torch.uint8))  # a tensor: indexed
    assert torch.equal(by_runs.tensor.view(torch.uint8), indexed.tensor.view(torch.uint8))
    assert by_runs.export_bytes(ids, 1, 3) == data
    assert torch.equal(by_runs.block_versions, indexed.block_versions)  # the decode mirror sees the write
    with pytest.raises(KvCacheError):
        by_runs.import_blocks(ids, 1, 3, data[:-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_filling_blocks_in_place_writes_what_an_import_writes_or_declines_untouched(dtype):
    from worker.kv_cache import MAX_VIEW_RUNS

    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=dtype, model_fingerprint="m")
    source = PagedKvCache(layout, 32)
    source.tensor.copy_(torch.randn(source.tensor.shape).to(source.dtype))
    for ids in ([3, 4, 5, 6], [9, 2, 3, 4], [7]):
        data = source.export_bytes(list(range(len(ids))), 1, 3)
        filled, imported = PagedKvCache(layout, 32), PagedKvCache(layout, 32)
        imported.import_blocks(ids, 1, 3, data)

        def copy(views, data=data):
            assert all(isinstance(view, memoryview) and not view.readonly for view in views)
            offset = 0
            for view in views:
                view[:] = data[offset : offset + view.nbytes]
                offset += view.nbytes
            assert offset == len(data)

        assert filled.fill_blocks(ids, 1, 3, copy)
        assert torch.equal(filled.tensor.view(torch.uint8), imported.tensor.view(torch.uint8))
        assert torch.equal(filled.block_versions, imported.block_versions)  # counted as written
    scattered = list(range(0, 2 * (MAX_VIEW_RUNS + 1), 2))
    cache = PagedKvCache(layout, 32)
    called = []
    assert not cache.fill_blocks(scattered, 0, 3, called.append)  # too many runs: import_blocks instead
    assert called == [] and int(cache.block_versions.sum()) == 0
    with pytest.raises(KvCacheError):
        cache.fill_blocks([3, 3], 0, 3, called.append)  # distinct ids, as for an import
    with pytest.raises(KvCacheError):
        cache.fill_blocks([3], 0, 4, called.append)
    assert called == []


def test_a_transfer_source_hands_out_views_of_the_cache_equal_to_its_gathered_read():
    from worker.kv_cache import MAX_VIEW_RUNS
    from worker.transfer_source import EngineTransferSource

    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bfloat16", model_fingerprint="m")
    cache = PagedKvCache(layout, 32)
    cache.tensor.copy_(torch.randn(cache.tensor.shape).to(cache.dtype))
    for ids in ([4, 5, 6, 7, 8], [10, 11, 2, 3, 20], list(range(0, 2 * (MAX_VIEW_RUNS + 1), 2))):
        source = EngineTransferSource(cache, layout, ids)
        for layers, blocks in (((0, 3), (0, len(ids))), ((1, 2), (1, len(ids) - 1))):
            parts = source.read_parts(*layers, *blocks)
            assert b"".join(bytes(part) for part in parts) == bytes(source.read(*layers, *blocks))
    # One view per layer, K or V and run of consecutive ids; past MAX_VIEW_RUNS runs, one gathered part.
    assert len(EngineTransferSource(cache, layout, [10, 11, 2, 3, 20]).read_parts(0, 3, 0, 5)) == 3 * 2 * 3
    scattered = list(range(0, 2 * (MAX_VIEW_RUNS + 1), 2))
    assert len(EngineTransferSource(cache, layout, scattered).read_parts(0, 3, 0, len(scattered))) == 1
    # Views, not copies: they see the cache's bytes as they are (the engine pins them for a push).
    source = EngineTransferSource(cache, layout, [4, 5])
    view = source.read_parts(0, 1, 0, 2)[0]
    cache.tensor[0, 0, 4].zero_()
    assert not any(bytes(view)[: cache.tensor[0, 0, 4].numel() * 2])
