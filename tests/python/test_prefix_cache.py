"""Prefix caching through mixkv.Engine: a second prompt with the same system
prompt (or the same video) shares the first one's cached blocks, prefills
only its own suffix over them, and attends as if it had computed the whole
prompt; the stats count it; bad token keys are refused by name."""

import zlib

import mixkv
import numpy as np
import pytest
from mixkv import Precision, Segment, TokenKind, TokenLayout

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
SYSTEM = 4 * BLOCK  # a system prompt of four whole blocks


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def row(kind, keys, position, layer, heads):
    """A token's K, V or Q row from the prompt up to it (as a causal model's
    would be): float16 [heads, HEAD_DIM]."""
    return seeded(kind, tuple(keys[: position + 1]), layer).standard_normal((heads, HEAD_DIM)).astype(np.float16)


def engine(prefix=True, share_higher=True):
    config = mixkv.CacheConfig(
        SHAPE,
        64 * 32 << 10,
        32 << 10,
        fp16_windows_first=True,
        prefix_cache=mixkv.PrefixCacheConfig(enabled=prefix, share_higher=share_higher),
    )
    return mixkv.Engine(config, mixkv.SchedulerConfig(max_num_batched_tokens=512), num_q_heads=Q_HEADS)


def serve(e, requests, new_tokens=3):
    """Runs requests (id -> (layout, keys, plan)) one after another to the
    end; returns each one's prefill outputs by prompt row, decode outputs,
    and the cached rows its admission found."""
    outs, decodes, cached = {}, {}, {}
    for rid, (layout, keys, plan) in requests.items():
        e.add_request(rid, layout, plan=plan, max_new_tokens=new_tokens, token_keys=keys)
        outs[rid], decodes[rid] = {}, []
        seq = list(keys)
        while e.has_unfinished():
            step = e.step()
            e.check_invariants()
            for p in step.prefills:
                cached.setdefault(p.request_id, p.start)
            rows = [(p.request_id, pos) for p in step.prefills for pos in range(p.start, p.end)]
            for layer in range(LAYERS):
                if rows:
                    q = np.stack([row("q", seq, pos, layer, Q_HEADS) for _, pos in rows])
                    k = np.stack([row("k", seq, pos, layer, KV_HEADS) for _, pos in rows])
                    v = np.stack([row("v", seq, pos, layer, KV_HEADS) for _, pos in rows])
                    out = e.prefill(layer, q, k, v)
                    for n, (_, pos) in enumerate(rows):
                        outs[rid][(layer, pos)] = out[n].astype(np.float32)
                if step.decodes:
                    pos = len(seq) - 1
                    q = row("q", seq, pos, layer, Q_HEADS)[None]
                    kv = row("k", seq, pos, layer, KV_HEADS)[None], row("v", seq, pos, layer, KV_HEADS)[None]
                    decodes[rid].append(e.attend(layer, q, *kv)[0].astype(np.float32))
            if step.decodes or any(p.last for p in step.prefills):
                seq.append(1000 + len(seq))  # the sampled token
    return outs, decodes, cached


def text_prompt(question_seed, question_len=10):
    keys = [7000 + i for i in range(SYSTEM)] + [
        int(t) for t in seeded("q", question_seed).integers(1, 500, question_len)
    ]
    return TokenLayout([Segment(TokenKind.Text, len(keys))]), keys, None


def test_shared_system_prompt_is_prefilled_once_and_attends_the_same():
    e = engine()
    requests = {"a": text_prompt(1), "b": text_prompt(2, 12)}
    outs, decodes, cached = serve(e, requests)
    assert cached == {"a": 0, "b": SYSTEM}  # b's first chunk starts after the shared blocks
    stats = e.stats()
    assert stats.prefix_hits == 1 and stats.cached_prompt_tokens == SYSTEM
    assert stats.prefill_tokens == SYSTEM + 10 + 12
    prefix = e.cache.prefix_stats()
    assert prefix.hits == 1 and prefix.hit_rows == SYSTEM and prefix.shared[0] == LAYERS * SYSTEM // BLOCK
    assert prefix.cached[0] >= LAYERS * SYSTEM // BLOCK  # the blocks outlive both requests
    assert prefix.evictable == prefix.cached  # nobody holds them now: they count as free
    # b alone in a cache without prefix caching computes every row: the same outputs.
    ref_outs, ref_decodes, ref_cached = serve(engine(prefix=False), {"b": requests["b"]})
    assert ref_cached == {"b": 0}
    for (layer, pos), o in outs["b"].items():
        np.testing.assert_allclose(o, ref_outs["b"][(layer, pos)], rtol=2e-3, atol=2e-3)
    for o, r in zip(decodes["b"], ref_decodes["b"]):
        np.testing.assert_allclose(o, r, rtol=2e-3, atol=2e-3)
    assert len(decodes["b"]) == len(ref_decodes["b"]) > 0


def video_prompt(question_seed, plan_precision):
    """(system 16 | video 4 windows | question 8); the video's keys are its
    frames' content hashes, the same for every question."""
    layout = TokenLayout(
        [Segment(TokenKind.Text, BLOCK), Segment(TokenKind.Visual, 4 * BLOCK), Segment(TokenKind.Text, 8)]
    )
    keys = [7000 + i for i in range(BLOCK)] + [(1 << 40) + i for i in range(4 * BLOCK)]
    keys += [int(t) for t in seeded("vq", question_seed).integers(1, 500, 8)]
    plan = mixkv.PrecisionPlan(LAYERS, 4)
    for layer in range(LAYERS):
        for w in range(1, 4):
            plan.set(layer, w, plan_precision)
    return layout, keys, plan


@pytest.mark.parametrize("share_higher", [True, False])
def test_one_video_two_questions_at_different_precisions(share_higher):
    e = engine(share_higher=share_higher)
    _, _, cached = serve(e, {"int4": video_prompt(1, Precision.INT4), "int2": video_prompt(2, Precision.INT2)})
    prefix = e.cache.prefix_stats()
    if share_higher:  # the INT2 question shares the video's INT4 windows: prefills only its question
        assert cached["int2"] == BLOCK + 4 * BLOCK
        assert prefix.shared[Precision.INT4.value] == LAYERS * 3
    else:  # the match ends at the first window cached above the wanted precision
        assert cached["int2"] == 2 * BLOCK
        assert prefix.shared[Precision.INT4.value] == 0
    e.check_invariants()


def test_token_keys_errors_name_the_argument_and_change_nothing():
    e = engine()
    before = e.describe_state()
    fn = "Engine.add_request"
    with pytest.raises(
        mixkv.InvalidArgument, match=rf"{fn}: token_keys: expected one key per prompt row \(20\), got 3"
    ):
        e.add_request("a", 20, max_new_tokens=1, token_keys=[1, 2, 3])
    with pytest.raises(mixkv.InvalidArgument, match=rf"{fn}: token_keys: expected keys >= 0, got -1"):
        e.add_request("a", 2, max_new_tokens=1, token_keys=np.array([-1, 2]))
    with pytest.raises(mixkv.InvalidArgument, match=rf"{fn}: token_keys: expected a 1-D integer array, got float32"):
        e.add_request("a", 2, max_new_tokens=1, token_keys=np.zeros(2, np.float32))
    with pytest.raises(mixkv.InvalidArgument, match=rf"{fn}: token_keys\[1\]: expected an int, got bool"):
        e.add_request("a", 2, max_new_tokens=1, token_keys=[1, True])
    with pytest.raises(mixkv.InvalidArgument, match=rf"{fn}: token_keys\[0\] = {1 << 64}: expected 0 <= key < 2\^64"):
        e.add_request("a", 2, max_new_tokens=1, token_keys=[1 << 64, 0])
    with pytest.raises(mixkv.InvalidArgument, match=rf"{fn}: token_keys: expected a sequence of ints"):
        e.add_request("a", 2, max_new_tokens=1, token_keys="ab")
    assert e.describe_state() == before and "a" not in e
    e.add_request("a", 2, max_new_tokens=1, token_keys=np.array([5, (1 << 64) - 1], np.uint64))
    assert "a" in e


def test_config_and_request_carry_the_prefix_fields():
    config = mixkv.CacheConfig(SHAPE, 1 << 20, 32 << 10, prefix_cache=mixkv.PrefixCacheConfig(True, share_higher=False))
    assert config.prefix_cache.enabled and not config.prefix_cache.share_higher
    assert (
        "prefix_cache=PrefixCacheConfig(enabled=True, share_higher=False, identity=PrefixIdentity.Precision, higher=PrefixHigher.Demote)"
        in repr(config)
    )
    assert not mixkv.CacheConfig(SHAPE, 1 << 20).prefix_cache.enabled
    r = mixkv.Request(1, TokenLayout([Segment(TokenKind.Text, 3)]), token_keys=[1, 2, 3])
    assert r.token_keys == [1, 2, 3]
    cache = mixkv.KVCacheManager(config)
    sched = mixkv.Scheduler(cache)
    sched.add_request(r)
    sched.step()
    assert sched.status(1).cached_tokens == 0
    assert cache.prefix_stats().hits == 0 and cache.evict_prefix_cache() == 0
