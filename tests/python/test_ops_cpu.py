"""mixkv.ops on the CPU backend: store, append, copy, decode attention and
merge against float64 references, quantization bounds, and bad input."""

import threading
import time

import mixkv
import numpy as np
import pytest
from helpers import (
    P,
    attention,
    dequantized_tokens,
    layout,
    make_cache,
    plan_of,
    random_kv,
    reference_decode,
    relative_error,
    store_sequence,
)

ops = mixkv.ops


def fp16_only(cache, lay):
    return mixkv.PrecisionPlan(cache.config.shape.num_layers, lay.num_windows(cache.config.shape.block_size))


def dense_decode(kv_per_seq, layer, q, sm_scale, kv_heads):
    """Float64 attention on the original FP16 K/V of each sequence."""
    batch, q_heads, dim = q.shape
    group = q_heads // kv_heads
    out = np.zeros((batch, q_heads, dim))
    lse = np.zeros((batch, q_heads))
    for b, kv in enumerate(kv_per_seq):
        k, v = kv[layer]
        for h in range(q_heads):
            g = h // group
            out[b, h], lse[b, h] = attention(q[b, h], k[:, g].astype(np.float64), v[:, g].astype(np.float64), sm_scale)
    return out, lse


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (9, 3, 128), (7, 1, 64)])
def test_fp16_cache_decode_equals_dense_attention(rng, q_heads, kv_heads, head_dim):
    cache = make_cache(num_kv_heads=kv_heads, head_dim=head_dim, arena_bytes=16 << 20)
    lays = [layout(("text", 1)), layout(("text", 31)), layout(("text", 5), ("visual", 92))]
    kv = [store_sequence(cache, i, lay, fp16_only(cache, lay), rng) for i, lay in enumerate(lays)]
    md = cache.decode_metadata([0, 1, 2])
    q = rng.standard_normal((3, q_heads, head_dim)).astype(np.float16)
    scale = 1.0 / np.sqrt(head_dim)
    for layer in range(2):
        out, lse = ops.paged_decode_attention(cache, md, layer, q)
        assert out.dtype == np.float32 and out.shape == (3, q_heads, head_dim) and lse.shape == (3, q_heads)
        want_out, want_lse = dense_decode(kv, layer, q, scale, kv_heads)
        assert relative_error(out, want_out) < 1e-5
        assert np.abs(lse - want_lse).max() < 1e-4


def test_mixed_precision_decode_equals_reference_on_dequantized_kv(rng):
    cache = make_cache(num_kv_heads=2, head_dim=64, arena_bytes=16 << 20)
    lay = layout(("text", 10), ("visual", 100), ("text", 6))
    store_sequence(cache, 1, lay, plan_of([[P.FP16, P.INT4, P.INT2], [P.INT2, P.INT2, P.INT4]]), rng)
    # Every token in quantized pools but the text: a sequence with no FP16 window.
    lay2 = layout(("visual", 97))
    store_sequence(cache, 2, lay2, plan_of([[P.INT4, P.INT4, P.INT2]] * 2), rng)
    md = cache.decode_metadata([1, 2])
    q = rng.standard_normal((2, 6, 64)).astype(np.float16)
    for layer in range(2):
        out, lse = ops.paged_decode_attention(cache, md, layer, q, sm_scale=0.1)
        want_out, want_lse = reference_decode(cache, md, layer, q, 0.1)
        assert relative_error(out, want_out) < 1e-5
        assert np.abs(lse - want_lse).max() < 1e-4


def test_store_prefill_round_trip(rng):
    cache = make_cache(num_kv_heads=3, head_dim=64)
    lay = layout(("text", 7), ("visual", 96))
    kv = store_sequence(cache, 1, lay, plan_of([[P.FP16, P.INT4, P.INT2]] * 2), rng)
    md = cache.decode_metadata([1])
    for head in range(3):
        k, v = dequantized_tokens(cache, md, 0, 0, head)
        orig_k, orig_v = kv[0][0][:, head].astype(np.float64), kv[0][1][:, head].astype(np.float64)
        # FP16 rows (text 7, window 0 at rows 7..38) come back exactly, densely packed in prompt order.
        assert np.array_equal(k[:39], orig_k[:39]) and np.array_equal(v[:39], orig_v[:39])
        # Quantized windows: every value within half a step of its group (plus FP16 rounding of scale and min).
        for rows, got, bits in ((slice(39, 71), slice(39, 71), 4), (slice(71, 103), slice(71, 103), 2)):
            for orig, deq, axis in ((orig_k[rows], k[got], 0), (orig_v[rows], v[got], 1)):
                step = (orig.max(axis=axis, keepdims=True) - orig.min(axis=axis, keepdims=True)) / (2**bits - 1)
                assert np.all(np.abs(deq - orig) <= 0.5 * step * 1.01 + 1e-2 * step + 1e-3)


def test_append_then_decode_sees_the_new_token(rng):
    cache = make_cache(num_kv_heads=2, head_dim=64)
    lays = [layout(("text", 32)), layout(("text", 17))]
    kv = [store_sequence(cache, i, lay, fp16_only(cache, lay), rng) for i, lay in enumerate(lays)]
    for _ in range(3):
        result = cache.append_tokens([0, 1])
        for layer in range(2):
            k, v = random_kv(rng, 2, 2, 64)
            ops.append(cache, k, v, result.slots[layer])
            for b in range(2):
                old_k, old_v = kv[b][layer]
                kv[b][layer] = (np.concatenate([old_k, k[b : b + 1]]), np.concatenate([old_v, v[b : b + 1]]))
    md = cache.decode_metadata([0, 1])
    q = rng.standard_normal((2, 4, 64)).astype(np.float16)
    for layer in range(2):
        out, _ = ops.paged_decode_attention(cache, md, layer, q)
        want, _ = dense_decode(kv, layer, q, 1 / 8, 2)
        assert relative_error(out, want) < 1e-5


def test_append_skips_padding_slots(rng):
    """Slot -1 pads a batch (an engine's fixed-size buffers): that row is neither written nor checked."""
    cache = make_cache(num_kv_heads=2, head_dim=64)
    lay = layout(("text", 20))
    store_sequence(cache, 0, lay, fp16_only(cache, lay), rng)
    slot = int(cache.append_tokens([0]).slots[0][0])
    before = cache.arena.copy()
    k, v = random_kv(rng, 3, 2, 64)
    k[0, 1, 3] = np.nan  # in a padding row
    ops.append(cache, k, v, [-1, slot, -1])
    changed = np.flatnonzero(cache.arena != before)
    assert 0 < changed.size <= 2 * 2 * 64 * 2  # one token: K and V of 2 heads, 64 halves each
    with pytest.raises(
        IndexError, match=r"append: fp16_slots\[0\] = -2, expected -1 \(a padding row\) or 0 <= fp16_slots\[0\] < "
    ):
        ops.append(cache, k, v, [-2, slot, -1])


def test_copy_blocks_after_fork(rng):
    cache = make_cache()
    lay = layout(("text", 40))
    store_sequence(cache, 1, lay, fp16_only(cache, lay), rng)
    cache.fork(1, 2)
    result = cache.append_tokens([2])
    assert len(result.copies) == 2
    ops.copy_blocks(cache, result.copies)
    for c in result.copies:
        assert np.array_equal(cache.block(P.FP16, c.src), cache.block(P.FP16, c.dst))
    q = rng.standard_normal((1, 2, 64)).astype(np.float16)
    for layer in range(2):
        k, v = random_kv(rng, 1, 2, 64)
        ops.append(cache, k, v, result.slots[layer])
    # The parent never sees the child's token; the child sees the parent's prompt.
    out_parent, _ = ops.paged_decode_attention(cache, cache.decode_metadata([1]), 0, q)
    out_child, _ = ops.paged_decode_attention(cache, cache.decode_metadata([2]), 0, q)
    assert not np.allclose(out_parent, out_child)
    assert cache.num_tokens(2) == 41 and cache.num_tokens(1) == 40


def test_decode_accepts_outputs_and_empty_sequences(rng):
    cache = make_cache()
    lay = layout(("text", 3))
    store_sequence(cache, 1, lay, fp16_only(cache, lay), rng)
    md = cache.decode_metadata([1])
    q = rng.standard_normal((1, 2, 64)).astype(np.float16)
    out = np.full((1, 2, 64), np.nan, np.float32)
    lse = np.full((1, 2), np.nan, np.float32)
    got_out, got_lse = ops.paged_decode_attention(cache, md, 1, q, out=out, lse=lse)
    assert got_out is out and got_lse is lse and np.isfinite(out).all()
    # An empty batch entry: tables with no blocks give out 0 and lse -inf.
    empty = cache.decode_metadata([1])
    for p in P:
        t = empty.table(1, p)
        t.indptr, t.indices, t.last_block_len = [0, 0], [], [0]
    out, lse = ops.paged_decode_attention(cache, empty, 1, q)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_merge_states_matches_the_formula(rng):
    out_a = rng.standard_normal((3, 5, 64)).astype(np.float32)
    out_b = rng.standard_normal((3, 5, 64)).astype(np.float32)
    lse_a = rng.standard_normal((3, 5)).astype(np.float32)
    lse_b = rng.standard_normal((3, 5)).astype(np.float32)
    lse_a[0, 0] = lse_b[0, 0] = -np.inf  # two empty states
    lse_a[1, 1] = -np.inf  # one empty state
    out, lse = ops.merge_states(out_a, lse_a, out_b, lse_b)
    want_lse = np.logaddexp(lse_a.astype(np.float64), lse_b)
    with np.errstate(invalid="ignore"):
        wa = np.where(np.isinf(lse_a), 0, np.exp(lse_a - want_lse))[..., None]
        wb = np.where(np.isinf(lse_b), 0, np.exp(lse_b - want_lse))[..., None]
    want_out = np.where(np.isinf(want_lse)[..., None], 0, out_a * wa + out_b * wb)
    assert not np.isnan(out).any()
    assert np.allclose(out, want_out, atol=1e-5) and np.allclose(lse, want_lse, atol=1e-5)
    assert lse[0, 0] == -np.inf and np.all(out[0, 0] == 0)
    assert np.allclose(out[1, 1], out_b[1, 1])
    # In place into a.
    ops.merge_states(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_a)
    assert np.array_equal(out_a, out) and np.array_equal(lse_a, lse)


def test_merged_pool_states_equal_one_decode(rng):
    """Decode of two disjoint key sets merged = decode of their union."""
    cache = make_cache()
    lays = [layout(("text", 45)), layout(("text", 20))]
    for i, lay in enumerate(lays):
        store_sequence(cache, i, lay, fp16_only(cache, lay), rng)
    q = rng.standard_normal((1, 2, 64)).astype(np.float16)
    out0, lse0 = ops.paged_decode_attention(cache, cache.decode_metadata([0]), 0, q)
    out1, lse1 = ops.paged_decode_attention(cache, cache.decode_metadata([1]), 0, q)
    out, lse = ops.merge_states(out0, lse0, out1, lse1)
    md0, md1 = cache.decode_metadata([0]), cache.decode_metadata([1])
    for h in range(2):  # query head h reads KV head h (no GQA here)
        k0, v0 = dequantized_tokens(cache, md0, 0, 0, h)
        k1, v1 = dequantized_tokens(cache, md1, 0, 0, h)
        want_out, want_lse = attention(q[0, h], np.concatenate([k0, k1]), np.concatenate([v0, v1]), 1 / 8)
        assert relative_error(out[0, h], want_out) < 1e-5 and abs(lse[0, h] - want_lse) < 1e-4


def test_read_head_validates_its_input():
    fmt = mixkv.BlockFormat(P.INT4, 1, 64, 32)
    with pytest.raises(ValueError, match="head_region: expected shape"):
        ops.read_head(fmt, np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="head_dim"):
        ops.read_head(mixkv.BlockFormat(P.INT4, 1, 60, 32), np.zeros(10, np.uint8))


class CudaLike:
    """What a torch CUDA tensor looks like to the host path."""

    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f2", "data": (0, False), "version": 2}


def test_bad_arrays_name_the_argument_and_change_nothing(rng):
    cache = make_cache()
    lay = layout(("text", 10), ("visual", 64))
    cache.add_sequence(1, lay, plan_of([[P.FP16, P.INT4]] * 2))
    mapping = cache.prefill_mapping(1, 0)
    k, v = random_kv(rng, 74, 2, 64)
    arena = cache.arena.copy()
    state = cache.describe_state()

    cases = [
        ((k.astype(np.float32), v, mapping), "k: expected dtype float16, got float32"),
        ((k, v[:-1], mapping), r"v: expected shape \(rows=74, num_kv_heads=2, head_dim=64\), got \(73, 2, 64\)"),
        ((k, np.asfortranarray(v), mapping), "v: expected a C-contiguous array"),
        ((k[:, :, :32], v, mapping), "k: expected shape"),
        ((k.tolist(), v, mapping), "k: expected a NumPy float16 array, got list"),
        ((CudaLike(), v, mapping), "k: expected a NumPy float16 array, got .*CudaLike in device memory"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.store_prefill(cache, *args)
    nan_k = k.copy()
    nan_k[3, 1, 5] = np.nan
    with pytest.raises(ValueError, match="k"):
        ops.store_prefill(cache, nan_k, v, mapping)
    bad = cache.prefill_mapping(1, 0)
    bad.fp16_slots = np.full(74, -2, np.int32)
    with pytest.raises(IndexError, match=r"mapping.fp16_slots\[0\] = -2"):
        ops.store_prefill(cache, k, v, bad)
    assert np.array_equal(cache.arena, arena) and cache.describe_state() == state

    ops.store_prefill(cache, k, v, mapping)
    md = cache.decode_metadata([1])
    q = rng.standard_normal((1, 4, 64)).astype(np.float16)
    with pytest.raises(ValueError, match=r"q: expected shape \(batch=1, num_q_heads, head_dim=64\)"):
        ops.paged_decode_attention(cache, md, 0, q[:, :, :32])
    with pytest.raises(ValueError, match="num_q_heads = 3"):
        ops.paged_decode_attention(cache, md, 0, np.zeros((1, 3, 64), np.float16))
    with pytest.raises(IndexError, match="layer = 2"):
        ops.paged_decode_attention(cache, md, 2, q)
    readonly = np.zeros((1, 4, 64), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out: expected a writable array"):
        ops.paged_decode_attention(cache, md, 0, q, out=readonly)
    with pytest.raises(ValueError, match="lse: expected dtype float32"):
        ops.paged_decode_attention(cache, md, 0, q, lse=np.zeros((1, 4), np.float64))
    with pytest.raises(ValueError, match="sm_scale"):
        ops.paged_decode_attention(cache, md, 0, q, sm_scale=-1.0)

    result = cache.append_tokens([1])
    with pytest.raises(ValueError, match="slots: expected an int32 NumPy array or a sequence of int"):
        ops.append(cache, k[:1], v[:1], "x")
    with pytest.raises(ValueError, match="slots: expected dtype int32, got int64"):
        ops.append(cache, k[:1], v[:1], result.slots[0].astype(np.int64))
    with pytest.raises(ValueError, match=r"slots\[0\] = 4294967296: expected a value that fits int32"):
        ops.append(cache, k[:1], v[:1], [2**32])
    with pytest.raises(ValueError, match="k: expected shape"):
        ops.append(cache, k[:2], v[:1], result.slots[0])
    ops.append(cache, k[:1], v[:1], [int(result.slots[0, 0])])  # a list of ints works too
    with pytest.raises(ValueError, match="onto itself"):
        ops.copy_blocks(cache, [mixkv.BlockCopy(3, 3)])
    with pytest.raises(ValueError, match="out_b: expected shape"):
        ops.merge_states(
            np.zeros((2, 8), np.float32), np.zeros(2, np.float32), np.zeros((3, 8), np.float32), np.zeros(2, np.float32)
        )
    with pytest.raises(TypeError):
        ops.store_prefill(mixkv.KVCacheManager(cache.config), k, v, mapping)


def test_long_calls_release_the_gil(rng):
    cache = make_cache(num_kv_heads=4, head_dim=128, arena_bytes=96 << 20, slab_bytes=2 << 20)
    lay = layout(("text", 2000))
    for i in range(8):
        store_sequence(cache, i, lay, fp16_only(cache, lay), rng)
    md = cache.decode_metadata(list(range(8)))
    q = rng.standard_normal((8, 16, 128)).astype(np.float16)
    ticks = 0
    done = threading.Event()

    def decode():
        # Repeated until it has run 100 ms, however fast one call is.
        start = time.perf_counter()
        while time.perf_counter() - start < 0.1:
            ops.paged_decode_attention(cache, md, 0, q)
        done.set()

    thread = threading.Thread(target=decode)
    thread.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    thread.join()
    # The calls take 100 ms; with the GIL held throughout each, this loop could
    # only tick between calls (a few times), not about every millisecond.
    assert ticks >= 25
