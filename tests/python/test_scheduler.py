"""mixkv.Scheduler through Python, and the manager's swap and demotion with
the CPU ops that carry them out."""

import mixkv
import numpy as np
import pytest
from helpers import P, layout, make_cache, plan_of, random_kv, store_sequence

ops = mixkv.ops


def prompt(rng, visual=200):
    lay = layout(("text", 10), ("visual", visual), ("text", 5))
    return lay, rng.standard_normal((lay.num_tokens, 32)).astype(np.float32)


def test_requests_flow_through_steps(rng):
    cache = make_cache(arena_bytes=8 << 20, slab_bytes=256 << 10)
    sched = mixkv.Scheduler(
        cache, mixkv.SchedulerConfig(max_num_batched_tokens=256, planner=mixkv.PlannerConfig([0.5, 0.2]))
    )
    lay, emb = prompt(rng)
    sched.add_request(mixkv.Request(1, lay, embeddings=emb, max_new_tokens=3))
    sched.add_request(mixkv.Request(2, lay, plan=mixkv.PrecisionPlan(2, 6), max_new_tokens=2))
    assert 1 in sched and sched.status(1).state == mixkv.RequestState.Waiting
    first = sched.step()
    assert [(c.id, c.start, c.end, c.last) for c in first.prefills] == [(1, 0, 215, True), (2, 0, 10, False)]
    assert first.prefills[0].mappings[0].num_rows == 215 and len(first.prefills[0].mappings) == 2
    assert first.num_batched_tokens == 225
    finished = []
    while sched.has_unfinished():
        out = sched.step()
        assert out.append.slots.shape == (2, len(out.decodes))
        assert out.metadata.batch_size == len(out.decodes)
        assert list(out.decode_slots) == [sched.status(i).slot for i in out.decodes]
        finished += [(f.id, f.reason, f.generated) for f in out.finished]
        sched.check_invariants()
    assert sorted(finished) == [(1, mixkv.FinishReason.Length, 3), (2, mixkv.FinishReason.Length, 2)]
    stats = sched.stats()
    assert stats.finished == 2 and stats.decode_tokens == 3 and stats.prefill_tokens == 430
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)


def test_finish_cancel_and_rejection(rng):
    cache = make_cache(arena_bytes=4 << 20, slab_bytes=256 << 10)
    sched = mixkv.Scheduler(cache, mixkv.SchedulerConfig(max_num_batched_tokens=512))
    lay, _ = prompt(rng)
    sched.add_request(mixkv.Request(1, lay, plan=mixkv.PrecisionPlan(2, 6), max_new_tokens=50))
    sched.add_request(mixkv.Request(2, lay, plan=mixkv.PrecisionPlan(2, 6), max_new_tokens=50))
    huge = layout(("text", 100_000))
    sched.add_request(mixkv.Request(3, huge, plan=mixkv.PrecisionPlan(2, 0)))
    out = sched.step()
    assert [(r.id, "cache" in r.reason or "budget" in r.reason or len(r.reason) > 0) for r in out.rejected] == [
        (3, True)
    ]
    assert sched.finish(1) is True and sched.cancel(2) is True and sched.cancel(2) is False
    out = sched.step()
    assert sorted((f.id, f.reason) for f in out.finished) == [
        (1, mixkv.FinishReason.Stopped),
        (2, mixkv.FinishReason.Cancelled),
    ]
    assert not sched.has_unfinished()
    with pytest.raises(KeyError):
        sched.finish(99)


def test_bad_requests_name_the_field(rng):
    cache = make_cache()
    sched = mixkv.Scheduler(cache)
    lay, emb = prompt(rng)
    with pytest.raises(ValueError, match="request"):
        sched.add_request(mixkv.Request(1, lay, plan=mixkv.PrecisionPlan(2, 6), embeddings=emb))  # both
    with pytest.raises(ValueError, match="embeddings"):
        sched.add_request(mixkv.Request(1, lay, embeddings=emb))  # no planner configured
    with pytest.raises(ValueError, match="request.embeddings: expected dtype"):
        sched.add_request(mixkv.Request(1, lay, embeddings=emb.astype(np.int32)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.add_request(mixkv.Request(1, lay, plan=mixkv.PrecisionPlan(2, 6), max_new_tokens=0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        mixkv.Scheduler(make_cache(), mixkv.SchedulerConfig(max_num_seqs=0))
    assert not sched.has_unfinished()


def test_swap_out_and_in_bring_the_bytes_back(rng):
    cache = make_cache(arena_bytes=4 << 20, slab_bytes=256 << 10)
    config = cache.config
    swapping = mixkv.KVCache(
        mixkv.CacheConfig(config.shape, config.arena_bytes, config.slab_bytes, swap_blocks=[16, 8, 8])
    )
    lay = layout(("text", 10), ("visual", 64))
    store_sequence(swapping, 1, lay, plan_of([[P.FP16, P.INT4]] * 2), rng)
    md = swapping.decode_metadata([1])
    q = rng.standard_normal((1, 2, 64)).astype(np.float16)
    before, _ = ops.paged_decode_attention(swapping, md, 0, q)
    held = swapping.blocks_held(1)
    copies = swapping.swap_out(1)
    assert len(copies) == sum(held) and swapping.is_swapped(1)
    ops.swap_blocks(swapping, copies, ops.SwapDirection.DeviceToHost)
    assert swapping.swap.size == swapping.swap_bytes()
    swapping.arena[:] = 0  # the device blocks may be reused meanwhile
    copies = swapping.swap_in(1)
    ops.swap_blocks(swapping, copies, ops.SwapDirection.HostToDevice)
    after, _ = ops.paged_decode_attention(swapping, swapping.decode_metadata([1]), 0, q)
    assert np.array_equal(before, after)
    swapping.check_invariants()


def test_demote_moves_a_window_and_ops_requantize_it(rng):
    shape = mixkv.CacheShape(2, 2, 64)
    cache = mixkv.KVCache(mixkv.CacheConfig(shape, 4 << 20, 256 << 10, fp16_windows_first=True))
    lay = layout(("text", 3), ("visual", 64))
    kv = store_sequence(cache, 1, lay, plan_of([[P.FP16, P.FP16]] * 2), rng)
    assert cache.why_not_demotable(1, 0, 0, P.INT4) is not None  # window 0 stays FP16
    assert cache.why_not_demotable(1, 0, 1, P.INT4) is None
    demote_ops = cache.demote([mixkv.Demotion(1, 0, 1, P.INT4)])
    assert [(d.src_precision, d.dst_precision) for d in demote_ops] == [(P.FP16, P.INT4)]
    ops.demote(cache, demote_ops)
    assert cache.plan(1).at(0, 1) == P.INT4
    # The demoted window holds what store_prefill writes for those values.
    reference = mixkv.KVCache(cache.config)
    reference.add_sequence(1, lay, plan_of([[P.FP16, P.INT4]] * 2))
    k, v = kv[0]
    ops.store_prefill(reference, k, v, reference.prefill_mapping(1, 0))
    got = cache.block(P.INT4, int(cache.blocks(1, 0, P.INT4)[0]))
    want = reference.block(P.INT4, int(reference.blocks(1, 0, P.INT4)[0]))
    assert np.array_equal(got, want)
    cache.check_invariants()


def test_text_only_requests_and_forks_through_python(rng):
    """A request with neither plan nor embeddings is FP16; fork() shares the
    parent's blocks; layer_metadata() feeds paged_decode_attention."""
    cache = make_cache(arena_bytes=8 << 20, slab_bytes=256 << 10)
    sched = mixkv.Scheduler(cache, mixkv.SchedulerConfig(max_num_batched_tokens=256, build_metadata=False))
    sched.add_request(mixkv.Request(1, layout(("text", 40)), max_new_tokens=6))
    out = sched.step()
    assert [(c.id, c.start, c.end, c.last) for c in out.prefills] == [(1, 0, 40, True)]
    shape = cache.config.shape
    for layer in range(shape.num_layers):
        k, v = random_kv(rng, 40, shape.num_kv_heads, shape.head_dim)
        ops.store_prefill(cache, k, v, out.prefills[0].mappings[layer])
    out = sched.step()
    assert list(out.decodes) == [1]
    with pytest.raises(KeyError):
        sched.fork(99, 2)
    before = sched.status(1).generated
    sched.fork(1, 2, max_new_tokens=2)
    with pytest.raises(ValueError):
        sched.fork(1, 2)  # the child id is taken
    assert sched.stats().forks == 1
    shared = cache.blocks(1, 0, mixkv.Precision.FP16)
    assert list(cache.blocks(2, 0, mixkv.Precision.FP16)) == list(shared)
    assert cache.ref_count(mixkv.Precision.FP16, int(shared[0])) == 2
    finished = []
    while sched.has_unfinished():
        out = sched.step()
        if out.append.copies:
            ops.copy_blocks(cache, out.append.copies)
        for layer in range(shape.num_layers):
            batch = len(out.decodes)
            if batch == 0:
                continue
            k, v = random_kv(rng, batch, shape.num_kv_heads, shape.head_dim)
            ops.append(cache, k, v, out.append.slots[layer])
            q = rng.standard_normal((batch, 2 * shape.num_kv_heads, shape.head_dim)).astype(np.float16)
            attn, lse = ops.paged_decode_attention(cache, sched.layer_metadata(layer), layer, q)
            assert attn.shape == q.shape and np.isfinite(lse).all()
        finished += [(f.id, f.generated) for f in out.finished]
        sched.check_invariants()
    assert sorted(finished) == [(1, 6), (2, before + 2)]  # the child counts the parent's tokens before the fork
    assert all(cache.pool_stats(p).used_blocks == 0 for p in P)
