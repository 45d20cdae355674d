"""Speculative decoding below the Engine: the manager's append_tokens with
counts and truncate, the scheduler's draft rows (SchedulerConfig.
num_speculative_tokens, speculate, accept, StepOutput.decode_rows) and
their caps (max_new_tokens, the token budget, memory: never a demotion or
preemption for drafts), with the error mapping (the C++ message, the right
exception, nothing changed). No attention runs here: the steps are held to
the page tables."""

import random

import mixkv
import numpy as np
import pytest
from helpers import P, layout

BLOCK = 16
SHAPE = mixkv.CacheShape(2, 2, 64, BLOCK)
LAYERS = SHAPE.num_layers


def manager(arena_bytes=8 << 20, slab_bytes=256 << 10, swap_blocks=None):
    config = mixkv.CacheConfig(SHAPE, arena_bytes, slab_bytes)
    if swap_blocks is not None:
        config = mixkv.CacheConfig(SHAPE, arena_bytes, slab_bytes, swap_blocks=swap_blocks)
    return mixkv.KVCacheManager(config)


def text(n):
    return layout(("text", n))


def slots_of(cache, seq, layer, tokens):
    """FP16 slots of token positions of a text-only sequence (its tokens are packed in order)."""
    blocks = cache.blocks(seq, layer, P.FP16)
    return [int(blocks[t // BLOCK]) * BLOCK + t % BLOCK for t in tokens]


# --------------------------------------------------------------------------------------------------------------------
# KVCacheManager: append_tokens(ids, counts), truncate


def test_append_tokens_with_counts_lays_rows_out_in_order():
    cache = manager()
    cache.add_sequence(1, text(20), mixkv.PrecisionPlan(LAYERS, 0))
    cache.add_sequence(2, text(30), mixkv.PrecisionPlan(LAYERS, 0))
    result = cache.append_tokens([1, 2], [3, 5])
    assert result.slots.shape == (LAYERS, 8) and result.slots.dtype == np.int32
    assert (cache.num_tokens(1), cache.num_tokens(2)) == (23, 35)
    for layer in range(LAYERS):
        # Sequence 1's rows first, then sequence 2's, which cross into a new block.
        assert result.slots[layer, :3].tolist() == slots_of(cache, 1, layer, range(20, 23))
        assert result.slots[layer, 3:].tolist() == slots_of(cache, 2, layer, range(30, 35))
    assert result.offsets.tolist() == [4, 14]
    assert result.tails_changed.tolist() == [1]
    assert result.tail_blocks.tolist() == [int(cache.blocks(2, layer, P.FP16)[-1]) for layer in range(LAYERS)]
    compact = cache.append_tokens([2, 1], np.array([2, 1], np.int32), mixkv.AppendSlots.Compact)
    assert compact.slots.size == 0 and compact.offsets.tolist() == [3, 7]
    assert (cache.num_tokens(1), cache.num_tokens(2)) == (24, 37)
    cache.check_invariants()


def test_counts_of_one_equal_the_one_token_call():
    a, b = manager(), manager()
    for cache in (a, b):
        cache.add_sequence(1, text(31), mixkv.PrecisionPlan(LAYERS, 0))
        cache.add_sequence(2, text(8), mixkv.PrecisionPlan(LAYERS, 0))
    one, counted = a.append_tokens([1, 2]), b.append_tokens([1, 2], [1, 1])
    for field in ("slots", "offsets", "tails_changed", "tail_blocks"):
        assert getattr(one, field).tolist() == getattr(counted, field).tolist(), field
    assert a.describe_state() == b.describe_state()


def test_truncate_drops_the_appended_tokens_and_restores_the_state():
    cache = manager()
    cache.add_sequence(1, text(20), mixkv.PrecisionPlan(LAYERS, 0))
    cache.add_sequence(2, text(30), mixkv.PrecisionPlan(LAYERS, 0))
    before = cache.describe_state()
    cache.append_tokens([1], [15])  # 35 tokens: a third block in each layer
    assert len(cache.blocks(1, 0, P.FP16)) == 3
    cache.truncate(1, 20)
    assert cache.describe_state() == before
    cache.append_tokens([1, 2], [4, 20])
    cache.truncate([1, 2], np.array([20, 30], np.int32))
    assert cache.describe_state() == before
    # Keep some: two of five drafts accepted.
    cache.append_tokens([2], [6])
    cache.truncate(2, 33)
    assert cache.num_tokens(2) == 33 and cache.fp16_tail_fill(2, 0) == 1
    cache.check_invariants()
    cache.free_sequence(1)
    cache.free_sequence(2)
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)


def test_speculative_manager_errors_name_the_argument_and_change_nothing():
    cache = manager(swap_blocks=[16, 16, 16])
    cache.add_sequence(1, text(20), mixkv.PrecisionPlan(LAYERS, 0))
    cache.add_sequence(2, text(30), mixkv.PrecisionPlan(LAYERS, 0))
    cache.append_tokens([1, 2], [2, 2])
    before = cache.describe_state()
    with pytest.raises(mixkv.InvalidArgument, match=r"counts has 2 entries, expected ids.size\(\) = 1"):
        cache.append_tokens([1], [1, 2])
    with pytest.raises(mixkv.InvalidArgument, match=r"counts\[1\] = 0, expected 1 <= count"):
        cache.append_tokens([1, 2], [1, 0])
    with pytest.raises(mixkv.InvalidArgument, match=r"append_tokens: counts\[0\]: expected an int, got float"):
        cache.append_tokens([1], [1.5])
    with pytest.raises(mixkv.InvalidArgument, match=r"append_tokens: counts: expected an int32 NumPy array"):
        cache.append_tokens([1], "2")
    with pytest.raises(mixkv.InvalidArgument, match=r"append_tokens: counts: expected dtype int32"):
        cache.append_tokens([1], np.array([2], np.int64))
    with pytest.raises(mixkv.UnknownId, match="99"):
        cache.append_tokens([1, 99], [1, 1])
    with pytest.raises(mixkv.InvalidArgument, match="repeats"):
        cache.append_tokens([1, 1], [1, 1])
    with pytest.raises(mixkv.InvalidArgument, match=r"num_tokens = 19, expected 20 <= num_tokens <= 22"):
        cache.truncate(1, 19)  # the prompt stays
    with pytest.raises(mixkv.InvalidArgument, match=r"num_tokens = 23, expected 20 <= num_tokens <= 22"):
        cache.truncate(1, 23)
    with pytest.raises(mixkv.UnknownId, match="99"):
        cache.truncate(99, 20)
    with pytest.raises(mixkv.InvalidArgument, match=r"num_tokens\[1\] = 29, expected 30 <= num_tokens <= 32"):
        cache.truncate([1, 2], [20, 29])  # all or nothing: sequence 1 keeps its tokens too
    with pytest.raises(mixkv.InvalidArgument, match=r"num_tokens has 1 entries, expected ids.size\(\) = 2"):
        cache.truncate([1, 2], [20])
    with pytest.raises(mixkv.InvalidArgument, match=r"truncate: num_tokens: expected an int32 NumPy array"):
        cache.truncate([1, 2], 20)
    assert cache.describe_state() == before
    cache.swap_out(2)
    with pytest.raises(mixkv.InvalidArgument, match="swapped"):
        cache.truncate(2, 30)
    with pytest.raises(mixkv.InvalidArgument, match="swapped"):
        cache.append_tokens([2], [2])
    cache.check_invariants()


def test_append_with_counts_is_all_or_nothing_under_out_of_memory():
    fp16_block = mixkv.BlockFormat(P.FP16, SHAPE.num_kv_heads, SHAPE.head_dim, BLOCK).block_bytes
    cache = manager(arena_bytes=8 * fp16_block, slab_bytes=4 * fp16_block)  # 8 FP16 blocks, 4 a layer
    cache.add_sequence(1, text(16), mixkv.PrecisionPlan(LAYERS, 0))
    cache.add_sequence(2, text(3), mixkv.PrecisionPlan(LAYERS, 0))
    before = cache.describe_state()
    with pytest.raises(mixkv.OutOfMemory, match="FP16"):
        cache.append_tokens([2, 1], [2, 33])  # sequence 1 would need 3 more blocks a layer
    assert cache.describe_state() == before
    cache.append_tokens([2, 1], [2, 32])  # 2 more a layer: the arena is full
    assert cache.free_slabs == 0 and cache.pool_stats(P.FP16).used_blocks == 8
    cache.check_invariants()


# --------------------------------------------------------------------------------------------------------------------
# Scheduler: draft rows, accept, the caps


def scheduler(cache=None, **config):
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 64)
    cache = cache or manager()
    return cache, mixkv.Scheduler(cache, mixkv.SchedulerConfig(**config))


def check_step(cache, sched, out, max_new_tokens=None):
    """decode_rows against the statuses, every row's slot against the page tables, the contract's caps
    (max_new_tokens: {request: its max_new_tokens})."""
    sched.check_invariants()
    batch = len(out.decodes)
    if out.decode_rows.size == 0:
        assert all(sched.status(r).drafts == 0 for r in out.decodes)
        return
    assert not (out.preempted or out.swapped_out or out.demotions), "drafts in a step that relieved memory pressure"
    rows = out.decode_rows.tolist()
    assert len(rows) == batch + 1 and rows[0] == 0
    assert out.num_batched_tokens == rows[-1] + sum(c.end - c.start for c in out.prefills)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    for i, r in enumerate(out.decodes):
        n = rows[i + 1] - rows[i]
        status = sched.status(r)
        assert status.drafts == n - 1
        if max_new_tokens is not None:
            assert status.generated + n - 1 <= max_new_tokens[r]  # generated counts the step's sampled token
        tokens = cache.num_tokens(r)
        assert out.append.offsets[i] == (tokens - n) % BLOCK
        if out.append.slots.size:
            assert out.append.slots.shape == (LAYERS, rows[-1])
            for layer in range(LAYERS):
                assert out.append.slots[layer, rows[i] : rows[i + 1]].tolist() == slots_of(
                    cache, r, layer, range(tokens - n, tokens)
                )


def test_accepted_drafts_count_toward_max_new_tokens():
    cache, sched = scheduler(num_speculative_tokens=3)
    assert sched.config.num_speculative_tokens == 3
    sched.add_request(mixkv.Request(1, text(20), max_new_tokens=10))
    sched.step()  # the prefill: its token is the first generated
    out = sched.step()
    check_step(cache, sched, out)
    assert out.decode_rows.tolist() == [0, 4] and out.decode_rows.dtype == np.int32
    assert out.num_batched_tokens == 4 and cache.num_tokens(1) == 24
    assert (sched.status(1).generated, sched.status(1).drafts) == (2, 3)
    sched.accept(1, 2)  # two drafts, then the token sampled after them
    assert (cache.num_tokens(1), sched.status(1).generated, sched.status(1).drafts) == (23, 4, 0)
    out = sched.step()
    check_step(cache, sched, out)
    assert out.decode_rows.tolist() == [0, 4]
    sched.accept(1, 3)
    assert sched.status(1).generated == 8
    out = sched.step()  # two tokens left: one draft at most
    check_step(cache, sched, out)
    assert out.decode_rows.tolist() == [0, 2]
    sched.accept(1, 1)
    out = sched.step()
    assert list(out.decodes) == [] and [(f.id, f.reason, f.generated) for f in out.finished] == [
        (1, mixkv.FinishReason.Length, 10)
    ]
    stats = sched.stats()
    assert (stats.draft_tokens, stats.accepted_tokens, stats.decode_tokens) == (7, 6, 3)
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)


def test_drafts_nobody_accepted_are_rejected_by_the_next_step():
    cache, sched = scheduler(num_speculative_tokens=5, per_layer_slots=False)
    sched.add_request(mixkv.Request(1, text(14), max_new_tokens=30))
    sched.step()
    sched.step()
    assert cache.num_tokens(1) == 20  # 14 + 1 + 5, across a block boundary
    out = sched.step()  # rejects the 5, then 1 + 5 rows again
    check_step(cache, sched, out)
    assert out.append.slots.size == 0 and out.decode_rows.tolist() == [0, 6]
    assert (sched.status(1).generated, cache.num_tokens(1)) == (3, 21)
    sched.accept(1, 0)
    assert cache.num_tokens(1) == 16
    assert sched.cancel(1)
    sched.step()
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)


def test_speculate_sets_one_decode_step():
    cache, sched = scheduler()
    sched.add_request(mixkv.Request(1, text(20), max_new_tokens=30))
    sched.add_request(mixkv.Request(2, text(20), max_new_tokens=30))
    sched.speculate(2, 4)  # still waiting: kept for its first decode
    sched.step()
    out = sched.step()
    check_step(cache, sched, out)
    rows = dict(zip(out.decodes, np.diff(out.decode_rows).tolist()))
    assert rows == {1: 1, 2: 5}
    sched.accept(2, 4)
    out = sched.step()
    assert out.decode_rows.size == 0  # the default again: plain decoding
    sched.speculate(1, 2)
    sched.speculate(1, 0)  # the last call counts
    out = sched.step()
    assert out.decode_rows.size == 0


def test_drafts_fit_the_token_budget_in_batch_order():
    cache, sched = scheduler(max_num_seqs=2, max_num_batched_tokens=32, num_speculative_tokens=20)
    sched.add_request(mixkv.Request(1, text(10), max_new_tokens=50))
    sched.add_request(mixkv.Request(2, text(10), max_new_tokens=50))
    sched.step()
    out = sched.step()
    check_step(cache, sched, out)
    assert out.decode_rows.tolist() == [0, 21, 32] and out.num_batched_tokens == 32


def test_drafts_never_demote_or_preempt():
    """Four slabs of 4 FP16 blocks: drafts take what is free, never a demotion or a preemption."""
    fp16_block = mixkv.BlockFormat(P.FP16, SHAPE.num_kv_heads, SHAPE.head_dim, BLOCK).block_bytes
    cache = manager(arena_bytes=16 * fp16_block, slab_bytes=4 * fp16_block)
    cache, sched = scheduler(cache, max_num_seqs=2, max_num_batched_tokens=64, num_speculative_tokens=40)
    sched.add_request(mixkv.Request(1, text(16), max_new_tokens=100))
    sched.add_request(mixkv.Request(2, text(16), max_new_tokens=100))
    sched.step()
    out = sched.step()
    check_step(cache, sched, out, {1: 100, 2: 100})
    drafts = {r: sched.status(r).drafts for r in out.decodes}
    # The budget leaves 62 rows: 40 for the first, 22 for the second, whose drafts would open blocks.
    assert drafts[1] == 40 and drafts[2] < 22
    rng = random.Random(5)
    sched.accept(1, rng.randint(0, drafts[1]))
    relieved = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.step()
        check_step(cache, sched, out, {1: 100, 2: 100})
        relieved += bool(out.preempted or out.swapped_out or out.demotions)
        for r in out.decodes:
            n = sched.status(r).drafts
            if n and rng.random() < 0.8:
                sched.accept(r, rng.randint(0, n))
    assert not sched.has_unfinished() and relieved > 0
    assert sched.stats().draft_tokens >= 40
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)


def test_fork_refuses_a_parent_with_drafts():
    cache, sched = scheduler(num_speculative_tokens=2)
    sched.add_request(mixkv.Request(1, text(20), max_new_tokens=10))
    sched.step()
    sched.step()
    before = sched.describe_state()
    with pytest.raises(mixkv.InvalidArgument, match=r"parent has 2 draft tokens awaiting accept\(\)"):
        sched.fork(1, 2)
    assert sched.describe_state() == before and 2 not in sched
    sched.accept(1, 1)
    sched.fork(1, 2)
    assert sched.status(2).state == mixkv.RequestState.Running and sched.status(2).drafts == 0
    sched.check_invariants()


def test_speculative_errors_name_the_argument_and_change_nothing():
    with pytest.raises(mixkv.InvalidArgument, match=r"num_speculative_tokens = -1, expected >= 0"):
        mixkv.Scheduler(manager(), mixkv.SchedulerConfig(num_speculative_tokens=-1))
    cache, sched = scheduler(num_speculative_tokens=3)
    sched.add_request(mixkv.Request(1, text(20), max_new_tokens=10))
    sched.step()
    with pytest.raises(mixkv.InvalidArgument, match=r"id = 1 has no draft tokens awaiting accept\(\)"):
        sched.accept(1, 0)
    sched.step()
    before = sched.describe_state()
    with pytest.raises(mixkv.UnknownId, match=r"id = 99 is not a live request"):
        sched.speculate(99, 1)
    with pytest.raises(mixkv.UnknownId, match=r"id = 99 is not a live request"):
        sched.accept(99, 0)
    with pytest.raises(mixkv.InvalidArgument, match=r"num_drafts = -1, expected >= 0"):
        sched.speculate(1, -1)
    with pytest.raises(mixkv.InvalidArgument, match=r"num_accepted = 4, expected 0 <= num_accepted <= 3"):
        sched.accept(1, 4)
    with pytest.raises(mixkv.InvalidArgument, match=r"num_accepted = -1, expected 0 <= num_accepted <= 3"):
        sched.accept(1, -1)
    with pytest.raises(TypeError):
        sched.accept(1, "2")
    assert sched.describe_state() == before and sched.status(1).drafts == 3
    sched.accept(1, 3)
    with pytest.raises(mixkv.InvalidArgument, match="no draft tokens"):
        sched.accept(1, 0)  # accepted already
    sched.check_invariants()
