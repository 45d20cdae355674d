"""Memory safety from Python: every op bounds-checks every id against the
cache it touches (one past the end, far past it, negative), configs come
back as copies, ops that release the GIL work on a snapshot, NaN planted in
a block is refused by demote, bools are not ints, and objects made without
__init__ raise instead of crashing. Each refused call changes nothing: the
arena, the swap buffer and describe_state() keep every byte."""

import threading

import mixkv
import numpy as np
import pytest
from helpers import P, layout, make_cache, plan_of, random_kv, store_sequence

ops = mixkv.ops
INT32_MAX = 2**31 - 1


def swap_cache(swap_blocks=(4, 4, 4)):
    shape = mixkv.CacheShape(2, 2, 64)
    return mixkv.KVCache(
        mixkv.CacheConfig(shape, 2 << 20, 256 << 10, swap_blocks=list(swap_blocks), fp16_windows_first=True)
    )


def pool_blocks(cache, p):
    return cache.total_slabs * cache.pool_stats(p).blocks_per_slab


class Unchanged:
    """Asserts that the block leaves the arena, the swap buffer and the
    bookkeeping exactly as they were."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        self.arena = self.cache.arena.copy()
        self.swap = self.cache.swap.copy()
        self.state = self.cache.describe_state()
        return self

    def __exit__(self, *exc):
        assert np.array_equal(self.cache.arena, self.arena)
        assert np.array_equal(self.cache.swap, self.swap)
        assert self.cache.describe_state() == self.state
        self.cache.check_invariants()
        return False


def out_of_range(name, value, limit):
    return rf"{name} = {value}, expected 0 <= {name} < {limit} "


@pytest.fixture
def stored(rng):
    """A cache holding one sequence with FP16, INT4 and INT2 windows."""
    cache = swap_cache()
    lay = layout(("text", 5), ("visual", 96))
    kv = store_sequence(cache, 1, lay, plan_of([[P.FP16, P.INT4, P.INT2]] * 2), rng)
    return cache, lay, kv


def bad_ids(limit):
    return [limit, limit + 1, 10**6, INT32_MAX, -2, -(10**6), -(2**31)]


def test_store_prefill_bounds_every_slot_and_window(stored):
    cache, _, kv = stored
    k, v = kv[0]
    slots = pool_blocks(cache, P.FP16) * 32
    for bad in bad_ids(slots):
        mapping = cache.prefill_mapping(1, 0)
        fp16 = mapping.fp16_slots
        fp16[-1] = bad
        mapping.fp16_slots = fp16
        with (
            Unchanged(cache),
            pytest.raises(
                mixkv.IndexOutOfRange, match=rf"store_prefill: mapping.fp16_slots\[100\] = {bad}, expected -1"
            ),
        ):
            ops.store_prefill(cache, k, v, mapping)
    for p, field in ((P.INT4, "int4_windows"), (P.INT2, "int2_windows")):
        limit = pool_blocks(cache, p)
        for bad in bad_ids(limit):
            mapping = cache.prefill_mapping(1, 0)
            windows = getattr(mapping, field)
            windows[0].block_id = bad
            setattr(mapping, field, windows)
            with (
                Unchanged(cache),
                pytest.raises(mixkv.IndexOutOfRange, match=out_of_range(rf"mapping.{field}\[0\].block_id", bad, limit)),
            ):
                ops.store_prefill(cache, k, v, mapping)


def test_append_bounds_every_slot(stored, rng):
    cache, _, _ = stored
    k, v = random_kv(rng, 2, 2, 64)
    slots = pool_blocks(cache, P.FP16) * 32
    for bad in bad_ids(slots):
        with (
            Unchanged(cache),
            pytest.raises(
                mixkv.IndexOutOfRange,
                match=rf"append: fp16_slots\[1\] = {bad}, expected -1 \(a padding row\) "
                rf"or 0 <= fp16_slots\[1\] < {slots} ",
            ),
        ):
            ops.append(cache, k, v, [-1, bad])
    before = cache.arena.copy()
    ops.append(cache, k, v, [-1, slots - 1])  # the last slot is in range
    assert not np.array_equal(cache.arena, before)


def test_copy_blocks_bounds_every_block(stored):
    cache, _, _ = stored
    for p in (P.FP16, P.INT4, P.INT2):
        limit = pool_blocks(cache, p)
        for bad in bad_ids(limit):
            with (
                Unchanged(cache),
                pytest.raises(
                    mixkv.IndexOutOfRange, match="copy_blocks: " + out_of_range(r"copies\[1\].dst", bad, limit)
                ),
            ):
                ops.copy_blocks(cache, [mixkv.BlockCopy(0, 1), mixkv.BlockCopy(2, bad)], p)
            with Unchanged(cache), pytest.raises(mixkv.IndexOutOfRange, match=rf"copies\[0\].src = {bad}"):
                ops.copy_blocks(cache, [mixkv.BlockCopy(bad, 1)], p)
    with Unchanged(cache), pytest.raises(IndexError, match="copies"):
        ops.copy_blocks(cache, [mixkv.BlockCopy(0, 10**6)])  # the example


def test_swap_blocks_bounds_device_blocks_and_host_slots(stored):
    cache, _, _ = stored
    for p in (P.FP16, P.INT4, P.INT2):
        blocks = pool_blocks(cache, p)
        for direction in (ops.SwapDirection.DeviceToHost, ops.SwapDirection.HostToDevice):
            for bad in bad_ids(blocks):
                with (
                    Unchanged(cache),
                    pytest.raises(mixkv.IndexOutOfRange, match=out_of_range(r"copies\[1\].device_block", bad, blocks)),
                ):
                    ops.swap_blocks(cache, [mixkv.SwapCopy(p, 0, 0), mixkv.SwapCopy(p, bad, 1)], direction)
            for bad in bad_ids(4):
                with (
                    Unchanged(cache),
                    pytest.raises(mixkv.IndexOutOfRange, match=out_of_range(r"copies\[0\].host_slot", bad, 4)),
                ):
                    ops.swap_blocks(cache, [mixkv.SwapCopy(p, 0, bad)], direction)
    ops.swap_blocks(cache, [mixkv.SwapCopy(P.INT2, pool_blocks(cache, P.INT2) - 1, 3)], ops.SwapDirection.DeviceToHost)


def test_a_cache_without_swap_pool_refuses_every_swap_copy():
    cache = make_cache()
    assert cache.swap_bytes() == 0
    for p in (P.FP16, P.INT4, P.INT2):
        with Unchanged(cache), pytest.raises(mixkv.IndexOutOfRange, match=out_of_range(r"copies\[0\].host_slot", 0, 0)):
            ops.swap_blocks(cache, [mixkv.SwapCopy(p, 0, 0)], ops.SwapDirection.DeviceToHost)


def test_demote_ops_of_another_cache_are_bounded(rng):
    """DemoteOps can only come from a manager: those of a large cache, given to a
    small one, name blocks past its pools."""
    big = mixkv.KVCache(mixkv.CacheConfig(mixkv.CacheShape(1, 2, 64), 16 << 20, 256 << 10, fp16_windows_first=True))
    lay = layout(("text", 3), ("visual", 64))
    for i in range(40):
        big.add_sequence(i, lay, plan_of([[P.FP16, P.FP16]]))
    demote_ops = big.demote([mixkv.Demotion(39, 0, 1, P.INT2)])
    small = mixkv.KVCache(mixkv.CacheConfig(mixkv.CacheShape(1, 2, 64), 256 << 10, 256 << 10))
    assert demote_ops[0].src_block >= pool_blocks(small, P.FP16)
    with (
        Unchanged(small),
        pytest.raises(
            mixkv.IndexOutOfRange,
            match="demote: " + out_of_range(r"ops\[0\].src_block", demote_ops[0].src_block, pool_blocks(small, P.FP16)),
        ),
    ):
        ops.demote(small, demote_ops)


def test_decode_bounds_every_page_table_id(stored, rng):
    cache, _, _ = stored
    md = cache.decode_metadata([1])
    q = rng.standard_normal((1, 4, 64)).astype(np.float16)
    want, _ = ops.paged_decode_attention(cache, md, 1, q)
    for p in (P.FP16, P.INT4, P.INT2):
        limit = pool_blocks(cache, p)
        for bad in bad_ids(limit):
            table = md.table(1, p)
            good = table.indices
            indices = good.copy()
            indices[0] = bad
            table.indices = indices
            name = rf"tables\[{p.name}\].indices\[0\]"
            with Unchanged(cache), pytest.raises(mixkv.IndexOutOfRange, match=out_of_range(name, bad, limit)):
                ops.paged_decode_attention(cache, md, 1, q)
            table.indices = good
    got, _ = ops.paged_decode_attention(cache, md, 1, q)
    assert np.array_equal(got, want)


def test_decode_refuses_overlapping_out_and_lse(stored, rng):
    cache, _, _ = stored
    md = cache.decode_metadata([1])
    q = rng.standard_normal((1, 4, 64)).astype(np.float16)
    memory = np.zeros(4 * 64 + 4, np.float32)
    out = memory[:256].reshape(1, 4, 64)
    for lse in (memory[:4].reshape(1, 4), memory[254:258].reshape(1, 4)):
        with pytest.raises(ValueError, match="out overlaps lse: expected disjoint memory"):
            ops.paged_decode_attention(cache, md, 0, q, out=out, lse=lse)
    assert not memory.any()
    ops.paged_decode_attention(cache, md, 0, q, out=out, lse=memory[256:].reshape(1, 4))  # disjoint: fine


def test_configs_are_copies():
    cache = make_cache()
    config = cache.config
    slab = config.slab_bytes
    config.slab_bytes = 1 << 20
    config.shape.block_size = 16
    config.swap_blocks = [1, 2, 3]
    assert cache.config.slab_bytes == slab and cache.config.shape.block_size == 32
    assert list(cache.config.swap_blocks) == [0, 0, 0]
    cache.check_invariants()

    sched = mixkv.Scheduler(make_cache(), mixkv.SchedulerConfig(max_num_seqs=3))
    sc = sched.config
    sc.max_num_seqs = 100
    sc.watermark = 0.5
    assert sched.config.max_num_seqs == 3 and sched.config.watermark != 0.5
    sched.check_invariants()

    planner = mixkv.WindowPlanner(mixkv.PlannerConfig([0.5, 0.9]))
    pc = planner.config
    pc.alpha = 7.0
    pc.sensitivities = [0.1]
    assert planner.config.alpha == 2.0 and list(planner.config.sensitivities) == [0.5, 0.9]
    assert planner.num_layers == 2


def test_decode_works_on_a_snapshot_of_its_metadata(rng):
    """A second thread assigns bad and good page lists to the metadata while
    decodes run with the GIL released: each decode either gives the result of
    one consistent table (here always the good one: the bad one is refused)
    or raises IndexOutOfRange, never crashes or reads out of bounds."""
    cache = make_cache(num_kv_heads=2, head_dim=64, arena_bytes=8 << 20)
    lay = layout(("text", 700))
    for i in range(4):
        store_sequence(cache, i, lay, mixkv.PrecisionPlan(2, 0), rng)
    md = cache.decode_metadata([0, 1, 2, 3])
    q = rng.standard_normal((4, 4, 64)).astype(np.float16)
    want, want_lse = ops.paged_decode_attention(cache, md, 0, q)
    table = md.table(0, P.FP16)
    good = table.indices
    bad = good.copy()
    bad[len(bad) // 2] = -1
    stop = threading.Event()

    def mutate():
        while not stop.is_set():
            table.indices = bad
            table.indices = good

    thread = threading.Thread(target=mutate)
    thread.start()
    results = {"ok": 0, "refused": 0}
    try:
        for _ in range(60):
            try:
                out, lse = ops.paged_decode_attention(cache, md, 0, q)
            except mixkv.IndexOutOfRange as error:
                assert "indices" in str(error)
                results["refused"] += 1
            else:
                assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
                results["ok"] += 1
    finally:
        stop.set()
        thread.join()
    assert results["ok"] + results["refused"] == 60


def test_store_prefill_works_on_a_snapshot_of_its_mapping(rng):
    cache = make_cache()
    lay = layout(("text", 200))
    cache.add_sequence(1, lay, mixkv.PrecisionPlan(2, 0))
    mapping = cache.prefill_mapping(1, 0)
    good = mapping.fp16_slots
    bad = good.copy()
    bad[100] = 10**6
    k, v = random_kv(rng, 200, 2, 64)
    stop = threading.Event()

    def mutate():
        while not stop.is_set():
            mapping.fp16_slots = bad
            mapping.fp16_slots = good

    thread = threading.Thread(target=mutate)
    thread.start()
    try:
        for _ in range(200):
            try:
                ops.store_prefill(cache, k, v, mapping)
            except mixkv.IndexOutOfRange as error:
                assert "fp16_slots[100] = 1000000" in str(error)
    finally:
        stop.set()
        thread.join()
    cache.check_invariants()


def test_nan_planted_in_a_block_is_refused_by_demote(rng):
    cache = swap_cache()
    lay = layout(("text", 3), ("visual", 64))
    store_sequence(cache, 1, lay, plan_of([[P.FP16, P.FP16]] * 2), rng)
    demote_ops = cache.demote([mixkv.Demotion(1, 0, 1, P.INT4)])
    (op,) = demote_ops
    block = cache.block(P.FP16, op.src_block)  # a view into the arena
    block[100:102] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    with (
        Unchanged(cache),
        pytest.raises(mixkv.InvalidArgument, match=rf"demote: ops\[0\]: FP16 block {op.src_block} head 0: .* is NaN"),
    ):
        ops.demote(cache, demote_ops)
    block[100:102] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    with Unchanged(cache), pytest.raises(ValueError, match=r"spans \[.*inf"):
        ops.demote(cache, demote_ops)
    block[100:102] = 0
    ops.demote(cache, demote_ops)


def test_bools_are_not_slots_or_ids(stored, rng):
    cache, _, _ = stored
    k, v = random_kv(rng, 1, 2, 64)
    for flag in (True, False, np.bool_(True)):
        with Unchanged(cache), pytest.raises(ValueError, match=r"append: slots\[0\]: expected an int, got .*bool"):
            ops.append(cache, k, v, [flag])
    with pytest.raises(ValueError, match=r"slots: expected dtype int32, got bool"):
        ops.append(cache, k, v, np.array([True]))
    table = mixkv.PagedPoolTable()
    with pytest.raises(ValueError, match=r"PagedPoolTable.indices\[1\]: expected an int"):
        table.indices = [0, True]
    mapping = mixkv.StoreMapping()
    with pytest.raises(ValueError, match=r"StoreMapping.fp16_slots\[0\]: expected an int"):
        mapping.fp16_slots = [True]


@pytest.mark.parametrize(
    "cls",
    [
        mixkv.KVCache,
        mixkv.KVCacheManager,
        mixkv.Scheduler,
        mixkv.WindowPlanner,
        mixkv.PrecisionPlan,
        mixkv.TokenLayout,
        mixkv.BlockFormat,
        mixkv.StoreMapping,
        mixkv.PagedPoolTable,
        mixkv.DecodeMetadata,
        mixkv.CacheConfig,
        mixkv.SchedulerConfig,
        mixkv.StepOutput,
        mixkv.DemoteOp,
    ],
)
def test_objects_cannot_be_made_without_init(cls):
    """Class.__new__ alone would leave an object without a C++ value, whose
    first use read uninitialized memory: it is not available."""
    with pytest.raises(AttributeError, match=rf"{cls.__name__}.__new__ is not available: construct with"):
        cls.__new__(cls)
    with pytest.raises(TypeError):
        object.__new__(cls)


def test_construction_and_python_subclasses_still_work():
    class Cache(mixkv.KVCache):
        def __init__(self, config):
            super().__init__(config)
            self.extra = 1

    cache = Cache(make_cache().config)
    assert cache.extra == 1 and cache.total_slabs == make_cache().total_slabs
    cache.check_invariants()
    assert isinstance(cache, mixkv.KVCacheManager)
    assert type(mixkv.KVCache).__name__ == "InitOnlyType"


def test_resource_sized_arguments_are_bounded_before_allocation():
    """A swap pool or arena no host could hold is refused with a clear error
    before anything is allocated (the bookkeeping of [2**31 - 1] * 3 swap
    slots alone once exhausted memory)."""
    shape = mixkv.CacheShape(2, 2, 64)
    with pytest.raises(mixkv.InvalidArgument, match="swap_blocks"):
        mixkv.KVCache(mixkv.CacheConfig(shape, 4 << 20, 256 << 10, swap_blocks=[INT32_MAX] * 3))
    with pytest.raises(mixkv.InvalidArgument, match="arena_bytes"):
        mixkv.KVCache(mixkv.CacheConfig(shape, 1 << 50, 256 << 10))
