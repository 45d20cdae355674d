"""Helpers shared by the mixkv pytest suite. Sizes are small and odd on
purpose (testing.md)."""

import mixkv
import numpy as np
from mixkv import Precision, Segment, TokenKind, TokenLayout

P = Precision


def layout(*segments):
    """layout(("text", 10), ("visual", 100), ...) -> TokenLayout."""
    kinds = {"text": TokenKind.Text, "visual": TokenKind.Visual}
    return TokenLayout([Segment(kinds[kind], length) for kind, length in segments])


def plan_of(rows):
    """A PrecisionPlan from [[precision per window] per layer]."""
    plan = mixkv.PrecisionPlan(len(rows), len(rows[0]))
    for layer, row in enumerate(rows):
        for window, precision in enumerate(row):
            plan.set(layer, window, precision)
    return plan


def make_cache(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, arena_bytes=8 << 20, slab_bytes=512 << 10, cls=None
):
    shape = mixkv.CacheShape(num_layers, num_kv_heads, head_dim, block_size)
    return (cls or mixkv.KVCache)(mixkv.CacheConfig(shape, arena_bytes, slab_bytes))


def random_kv(rng, rows, heads, dim, k_scale=1.0, v_scale=1.0):
    k = (rng.standard_normal((rows, heads, dim)) * k_scale).astype(np.float16)
    v = (rng.standard_normal((rows, heads, dim)) * v_scale).astype(np.float16)
    return k, v


def store_sequence(cache, seq_id, lay, plan, rng):
    """add_sequence + store_prefill of every layer; returns [layer] -> (k, v)."""
    shape = cache.config.shape
    cache.add_sequence(seq_id, lay, plan)
    kv = []
    for layer in range(shape.num_layers):
        k, v = random_kv(rng, lay.num_tokens, shape.num_kv_heads, shape.head_dim, 2.0, 0.7)
        mixkv.ops.store_prefill(cache, k, v, cache.prefill_mapping(seq_id, layer))
        kv.append((k, v))
    return kv


def dequantized_tokens(cache, metadata, layer, batch_index, head):
    """K, V (float64 [tokens, head_dim]) of one sequence and KV head, read
    block by block through ops.read_head: the values every kernel sees."""
    ks, vs = [], []
    for p in (P.FP16, P.INT4, P.INT2):
        table = metadata.table(layer, p)
        fmt = cache.format(p)
        first, last = table.indptr[batch_index], table.indptr[batch_index + 1]
        for j in range(first, last):
            block = cache.block(p, int(table.indices[j]))
            region = block[head * fmt.head_bytes : (head + 1) * fmt.head_bytes]
            k, v = mixkv.ops.read_head(fmt, region)
            tokens = table.last_block_len[batch_index] if j == last - 1 else fmt.block_size
            ks.append(k[:tokens])
            vs.append(v[:tokens])
    dim = cache.config.shape.head_dim
    if not ks:
        return np.zeros((0, dim)), np.zeros((0, dim))
    return np.concatenate(ks).astype(np.float64), np.concatenate(vs).astype(np.float64)


def read_back_windows(cache, seq_id, layer, k, v):
    """k, v (float64 [rows, num_kv_heads, head_dim] of a sequence's prompt)
    with the rows of its INT4/INT2 windows in `layer` replaced by what the
    cache holds (ops.read_head); FP16 rows stay as given."""
    mapping = cache.prefill_mapping(seq_id, layer)
    for precision, windows in ((P.INT4, mapping.int4_windows), (P.INT2, mapping.int2_windows)):
        fmt = cache.format(precision)
        for w in windows:
            block = cache.block(precision, w.block_id)
            for h in range(fmt.num_kv_heads):
                wk, wv = mixkv.ops.read_head(fmt, block[h * fmt.head_bytes : (h + 1) * fmt.head_bytes])
                k[w.first_row : w.first_row + fmt.block_size, h] = wk
                v[w.first_row : w.first_row + fmt.block_size, h] = wv
    return k, v


def attention(q, k, v, sm_scale):
    """One query head over [tokens, dim] K/V in float64: (out, lse)."""
    if len(k) == 0:
        return np.zeros(q.shape[-1]), -np.inf
    scores = (k @ q.astype(np.float64)) * sm_scale
    m = scores.max()
    p = np.exp(scores - m)
    return (p @ v) / p.sum(), m + np.log(p.sum())


def reference_decode(cache, metadata, layer, q, sm_scale):
    """Float64 decode attention on the dequantized K/V of the cache."""
    batch, q_heads, dim = q.shape
    kv_heads = cache.config.shape.num_kv_heads
    group = q_heads // kv_heads
    out = np.zeros((batch, q_heads, dim))
    lse = np.zeros((batch, q_heads))
    for b in range(batch):
        for g in range(kv_heads):
            k, v = dequantized_tokens(cache, metadata, layer, b, g)
            for h in range(g * group, (g + 1) * group):
                out[b, h], lse[b, h] = attention(q[b, h], k, v, sm_scale)
    return out, lse


def relative_error(got, want):
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
