"""KVCacheManager through Python: exact block counts, mappings, append,
fork, free, and the error mapping (the C++ message, the right exception, no
change to the cache)."""

import mixkv
import numpy as np
import pytest
from helpers import P, layout, make_cache, plan_of

# 10 text + 100 visual (3 windows + a 4-token tail) + 6 text = 116 tokens.
LAYOUT = (("text", 10), ("visual", 100), ("text", 6))
PLAN = [[P.FP16, P.INT4, P.INT2], [P.FP16, P.INT2, P.INT2]]


@pytest.fixture
def cache():
    return make_cache()


def test_add_sequence_allocates_what_demand_says(cache):
    lay, plan = layout(*LAYOUT), plan_of(PLAN)
    # Per layer: FP16 tokens 10 + 32 + 4 + 6 = 52 -> 2 blocks; then one block per quantized window.
    assert cache.demand(lay, plan) == [4, 1, 3]
    assert cache.can_allocate([4, 1, 3])
    cache.add_sequence(7, lay, plan)
    assert 7 in cache and cache.contains(7) and cache.sequence_ids() == [7]
    assert cache.num_tokens(7) == 116
    assert cache.layout(7) == lay and cache.plan(7) == plan
    assert [len(cache.blocks(7, 0, p)) for p in P] == [2, 1, 1]
    assert [len(cache.blocks(7, 1, p)) for p in P] == [2, 0, 2]
    assert cache.blocks(7, 0, P.FP16).dtype == np.int32
    assert cache.fp16_tail_fill(7, 0) == 20
    stats = mixkv.plan_stats(lay, plan, cache.config.shape)
    assert stats.blocks == [4, 1, 3]
    assert [s.used_blocks for s in (cache.pool_stats(p) for p in P)] == [4, 1, 3]
    for block in cache.blocks(7, 1, P.INT2):
        assert cache.ref_count(P.INT2, int(block)) == 1
    cache.check_invariants()


def test_prefill_mapping_places_every_row(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    mapping = cache.prefill_mapping(1, 0)
    slots = mapping.fp16_slots
    assert mapping.num_rows == 116 and slots.shape == (116,)
    assert (slots == -1).sum() == 64  # the INT4 and the INT2 window
    assert mapping.int4_windows == [mixkv.WindowSlot(int(cache.blocks(1, 0, P.INT4)[0]), 42)]
    assert [w.first_row for w in mapping.int2_windows] == [74]
    fp16 = slots[slots >= 0]
    assert len(set(fp16.tolist())) == 52
    # Several sequences' mappings concatenate for one batched store.
    cache.add_sequence(2, layout(("text", 5)), mixkv.PrecisionPlan(2, 0))
    mapping.append(cache.prefill_mapping(2, 0))
    assert mapping.num_rows == 121


def test_append_tokens_grows_the_fp16_tail(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    cache.add_sequence(2, layout(("text", 32)), mixkv.PrecisionPlan(2, 0))
    result = cache.append_tokens([1, 2])
    assert result.slots.shape == (2, 2) and result.slots.dtype == np.int32
    assert result.copies == []
    assert cache.num_tokens(1) == 117 and cache.fp16_tail_fill(1, 0) == 21
    assert cache.fp16_tail_fill(2, 1) == 1  # a new FP16 block
    assert len(cache.blocks(2, 1, P.FP16)) == 2
    tail = int(cache.blocks(1, 1, P.FP16)[-1])
    assert result.slots[1, 0] == tail * 32 + 20
    # The compact form: the same slots as (tail block, offset), tails reported when they change.
    assert result.offsets.tolist() == [20, 0] and result.tails_changed.tolist() == [1]
    assert result.tail_blocks.tolist() == [int(cache.blocks(2, layer, P.FP16)[-1]) for layer in range(2)]
    compact = cache.append_tokens([1, 2], mixkv.AppendSlots.Compact)
    assert compact.slots.size == 0 and compact.offsets.tolist() == [21, 1]


def test_fork_shares_blocks_and_copies_the_tail_on_append(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    cache.fork(1, 2)
    shared = int(cache.blocks(1, 0, P.INT4)[0])
    assert cache.ref_count(P.INT4, shared) == 2
    result = cache.append_tokens([2])
    assert len(result.copies) == 2  # the shared partial FP16 tail of each layer
    copy = result.copies[0]
    assert copy.src == int(cache.blocks(1, 0, P.FP16)[-1]) and copy.dst == int(cache.blocks(2, 0, P.FP16)[-1])
    cache.check_invariants()


def test_free_returns_every_block(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    cache.free_sequence(1)
    assert cache.sequence_ids() == []
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)
    cache.check_invariants()


def test_decode_metadata_is_csr(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    cache.add_sequence(2, layout(("text", 40)), mixkv.PrecisionPlan(2, 0))
    md = cache.decode_metadata([2, 1])
    assert (md.batch_size, md.num_layers) == (2, 2)
    fp16 = md.table(0, P.FP16)
    assert fp16.indptr.tolist() == [0, 2, 4]
    assert fp16.last_block_len.tolist() == [8, 20]
    assert fp16.indices[2:].tolist() == cache.blocks(1, 0, P.FP16).tolist()
    int2 = md.table(1, P.INT2)
    assert int2.indptr.tolist() == [0, 0, 2] and int2.last_block_len.tolist() == [0, 32]
    # table() is a reference: assignments change the metadata.
    md.table(0, P.INT4).last_block_len = [0, 5]
    assert md.table(0, P.INT4).last_block_len.tolist() == [0, 5]
    with pytest.raises(IndexError, match="layer = 2"):
        md.table(2, P.FP16)


def test_errors_map_to_python_exceptions_and_change_nothing(cache):
    cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    before = cache.describe_state()

    with pytest.raises(KeyError, match="99 is not a sequence") as unknown:
        cache.num_tokens(99)
    assert isinstance(unknown.value, mixkv.UnknownId)
    with pytest.raises(mixkv.UnknownId):
        cache.append_tokens([1, 99])
    with pytest.raises(ValueError, match="already a sequence") as duplicate:
        cache.add_sequence(1, layout(*LAYOUT), plan_of(PLAN))
    assert isinstance(duplicate.value, mixkv.InvalidArgument)
    with pytest.raises(ValueError, match="plan.num_windows"):
        cache.add_sequence(2, layout(*LAYOUT), mixkv.PrecisionPlan(2, 2))
    with pytest.raises(ValueError, match="plan.num_layers"):
        cache.add_sequence(2, layout(*LAYOUT), mixkv.PrecisionPlan(3, 3))
    with pytest.raises(ValueError, match="repeats"):
        cache.append_tokens([1, 1])
    with pytest.raises(IndexError, match="layer") as index:
        cache.blocks(1, 5, P.FP16)
    assert isinstance(index.value, mixkv.IndexOutOfRange)
    with pytest.raises(MemoryError, match="out of memory") as oom:
        cache.add_sequence(3, layout(("text", 200_000)), mixkv.PrecisionPlan(2, 0))
    assert isinstance(oom.value, mixkv.OutOfMemory)
    assert not cache.contains(3)
    assert cache.describe_state() == before
    cache.check_invariants()


def test_bad_config_raises_value_error():
    with pytest.raises(ValueError, match="slab_bytes"):
        make_cache(slab_bytes=1024)
    with pytest.raises(ValueError, match="arena_bytes"):
        make_cache(arena_bytes=1024)


def test_exception_hierarchy():
    assert issubclass(mixkv.InvalidArgument, ValueError)
    assert issubclass(mixkv.OutOfMemory, MemoryError)
    assert issubclass(mixkv.UnknownId, KeyError)
    assert issubclass(mixkv.IndexOutOfRange, IndexError)
    assert issubclass(mixkv.InvariantViolation, RuntimeError)
    assert issubclass(mixkv.DeviceError, RuntimeError)


def test_kv_cache_is_a_manager_with_host_memory(cache):
    assert isinstance(cache, mixkv.KVCacheManager)
    assert cache.arena.shape == (8 << 20,) and cache.arena.dtype == np.uint8
    cache.add_sequence(1, layout(("text", 3)), mixkv.PrecisionPlan(2, 0))
    block_id = int(cache.blocks(1, 0, P.FP16)[0])
    block = cache.block(P.FP16, block_id)
    assert block.size == cache.format(P.FP16).block_bytes
    block[:4] = 7  # a view into the arena
    assert (cache.arena == 7).sum() >= 4
    with pytest.raises(IndexError, match="block_id"):
        cache.block(P.FP16, 10**6)
    # A bare manager has no memory and no block().
    manager = mixkv.KVCacheManager(cache.config)
    assert not hasattr(manager, "block")
