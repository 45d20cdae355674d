"""K/V stored into a mixkv.KVCache under a plan and read back as decode
attention sees them, and a continuation scored over such K/V in one causal
chunk instead of decode steps: how the plan sweep, the question sets and
the planner's measurements score a plan without running the engine."""

from __future__ import annotations

import math

import mixkv
import numpy as np
from mixkv import Precision, TokenLayout, ops
from model import SmolLM2, log_softmax
from task import WINDOW, Prompt


def cache_config(model: SmolLM2, layout: TokenLayout, plans, decode_tokens: int, sequences_per_plan: int):
    """A cache big enough for every plan's prompt (of this layout) plus its decode tokens
    (FP16 tails, copy-on-write after forks), rounded up to slabs."""
    c = model.config
    shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, WINDOW)
    slab = 2 << 20
    need = np.zeros(3)
    for plan in plans:
        need += np.asarray(mixkv.plan_stats(layout, plan, shape).blocks)
    tail_blocks = math.ceil(decode_tokens / WINDOW) + 2
    need[0] += len(plans) * sequences_per_plan * tail_blocks * c.num_layers
    slabs = 0
    for p in (Precision.FP16, Precision.INT4, Precision.INT2):
        per_slab = slab // mixkv.BlockFormat(p, c.num_kv_heads, c.head_dim, WINDOW).block_bytes
        slabs += math.ceil(need[int(p)] / per_slab) + 1
    return mixkv.CacheConfig(shape, slabs * slab, slab)


def store_sequence(cache, seq_id: int, layout: TokenLayout, plan, ks, vs):
    """Adds a sequence to a mixkv.KVCache under `plan` and stores every
    layer's prompt K/V into it (ops.store_prefill). For the paths that only
    store and read the blocks back (read_back); decoding goes through
    mixkv.Engine, which applies each step's memory moves itself."""
    cache.add_sequence(seq_id, layout, plan)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        ops.store_prefill(cache, k, v, cache.prefill_mapping(seq_id, layer))


def read_back(cache, seq_id: int, layer: int):
    """The K/V of one (sequence, layer) as every decode kernel sees them
    (dequantized, through ops.read_head), in pool order: [tokens, heads, d]."""
    shape = cache.config.shape
    md = cache.decode_metadata([seq_id])
    ks, vs = [], []
    for p in (Precision.FP16, Precision.INT4, Precision.INT2):
        table = md.table(layer, p)
        fmt = cache.format(p)
        last = int(table.indptr[1])
        for j in range(int(table.indptr[0]), last):
            block = cache.block(p, int(table.indices[j]))
            n = int(table.last_block_len[0]) if j == last - 1 else shape.block_size
            heads = [
                ops.read_head(fmt, block[h * fmt.head_bytes : (h + 1) * fmt.head_bytes])
                for h in range(shape.num_kv_heads)
            ]
            ks.append(np.stack([hk[:n] for hk, _ in heads], axis=1))
            vs.append(np.stack([hv[:n] for _, hv in heads], axis=1))
    return np.concatenate(ks), np.concatenate(vs)


def score_with_past(model: SmolLM2, past, ids, start: int, first_layer: int = 0, h=None, hidden_in=None):
    """Teacher-forced logits of `ids` after a cached prompt whose per-layer
    K/V (float32, any order: decode attention does not depend on it) are
    `past`: one causal chunk instead of len(ids) decode steps. Used for the
    plan sweep; the headline numbers come from real decode steps.
    With first_layer > 0, h is the chunk's hidden state entering that layer
    (layers before it are skipped); hidden_in, a list, collects the hidden
    state entering every layer run."""
    n = len(ids)
    positions = np.arange(start, start + n)
    if h is None:
        h = model.embedding[np.asarray(ids)].astype(np.float32)
    for layer, (pk, pv) in zip(model.layers[first_layer:], past[first_layer:]):
        if hidden_in is not None:
            hidden_in.append(h)
        h = h + attention_block(model, layer, h, positions, pk, pv)
        h = h + model.ffn(layer, h)
    return model.logits(h)


def attention_block(model: SmolLM2, layer, h, positions, pk, pv):
    """One layer's attention for a chunk of tokens (hidden states h at
    `positions`) after cached K/V (pk, pv: float32, any order), causal within
    the chunk: what the block adds to the residual stream, [n, hidden]."""
    c = model.config
    n = h.shape[0]
    group = c.num_heads // c.num_kv_heads
    scale = np.float32(1.0 / np.sqrt(c.head_dim))
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    q, k, v = model.qkv(layer, h, positions)
    out = np.empty((n, c.num_heads, c.head_dim), dtype=np.float32)
    for g in range(c.num_kv_heads):
        keys = np.concatenate([pk[:, g, :], k[:, g, :].astype(np.float32)])
        vals = np.concatenate([pv[:, g, :], v[:, g, :].astype(np.float32)])
        qg = q[:, g * group : (g + 1) * group, :].astype(np.float16).astype(np.float32) * scale
        s = qg.reshape(-1, c.head_dim) @ keys.T  # [n * group, past + n]
        s = s.reshape(n, group, -1)
        s[:, :, len(pk) :][np.broadcast_to(future[:, None, :], (n, group, n))] = -np.inf
        s -= s.max(axis=2, keepdims=True)
        np.exp(s, out=s)
        out[:, g * group : (g + 1) * group, :] = (s.reshape(-1, keys.shape[0]) @ vals).reshape(n, group, -1) / s.sum(
            axis=2, keepdims=True
        )
    return out.reshape(n, -1) @ layer.wo.T


def chunk_score(model: SmolLM2, cache, prompt: Prompt, plan, ks, vs):
    """A plan's KV bytes ratio and the answer's perplexity, scored in one
    causal chunk over the K/V stored under the plan and read back."""
    c = model.config
    store_sequence(cache, 0, prompt.layout, plan, ks, vs)
    past = [read_back(cache, 0, layer) for layer in range(c.num_layers)]
    cache.free_sequence(0)
    lp = log_softmax(score_with_past(model, past, prompt.answer[:-1], len(prompt.ids)))
    nll = -lp[np.arange(len(prompt.answer) - 1), prompt.answer[1:]]
    stats = mixkv.plan_stats(prompt.layout, plan, cache.config.shape)
    return {"bytes_ratio": stats.bytes / stats.fp16_bytes, "ppl": float(np.exp(nll.mean()))}
