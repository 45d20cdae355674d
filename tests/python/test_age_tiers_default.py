"""A text-only request's KV shrinks with age under the default age-tier
policy, mixkv.AgeTierPolicy() with nothing set (enabled, the first window
and the 4 most recent windows FP16, every older window INT4 in every layer),
through mixkv.Engine on the CPU backend; and the one-chunk replay of the
policy that examples/smollm2/policy_grid.py scores with gives the engine's
log-probabilities and bytes on a small random model."""

import mixkv
import numpy as np
from mixkv import Precision as P

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 3, 2, 4, 64, 16
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
PROMPT, NEW = 40, 140


def engine(tiers):
    cache = mixkv.CacheConfig(SHAPE, arena_bytes=4 << 20, slab_bytes=32 << 10, fp16_windows_first=True)
    config = mixkv.SchedulerConfig(max_num_batched_tokens=256, watermark=0.0, age_tiers=tiers)
    return mixkv.Engine(cache, config, num_q_heads=Q_HEADS, backend="cpu")


def used(eng, precision):
    stats = eng.cache.pool_stats(precision)
    return stats.used_blocks, stats.used_blocks * stats.block_bytes


def serve(eng, watch):
    """One text-only request (PROMPT tokens, NEW generated) to its end;
    watch(tokens held when the step began, engine) after each decode step."""
    rng = np.random.default_rng(0)
    eng.add_request("r", PROMPT, max_new_tokens=NEW)
    while eng.has_unfinished():
        tokens = eng.cache.num_tokens("r") if eng.cache.holds("r") else 0
        step = eng.step()
        for layer in range(LAYERS):
            if step.prefill_rows:
                n = step.prefill_rows
                k = rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float16)
                eng.store(layer, k, -k)
            if step.decodes:
                q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
                k = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
                eng.attend(layer, q, k, -k)
        eng.check_invariants()
        if "r" in step.decodes:
            watch(tokens, eng)


def test_default_policy_demotes_old_text_windows_to_int4():
    policy = mixkv.AgeTierPolicy()
    assert policy.enabled and policy.sink_windows == 1 and policy.recent_windows == 4
    assert list(policy.layer_floor) == []  # INT4 in every layer

    trace = []

    def watch(tokens, eng):
        # Full windows with at least 4 windows of tokens after them, window 0 aside, are INT4.
        old = [w for w in range(1, tokens // BLOCK) if tokens - 1 - (w * BLOCK + BLOCK - 1) >= 4 * BLOCK]
        for layer in range(LAYERS):
            assert len(eng.cache.blocks("r", layer, P.INT4)) == len(old)
            assert len(eng.cache.blocks("r", layer, P.INT2)) == 0
            # FP16 keeps the sink, the recent windows and the open tail.
            assert len(eng.cache.blocks("r", layer, P.FP16)) == -(-(tokens + 1 - len(old) * BLOCK) // BLOCK)
        trace.append((tokens, used(eng, P.FP16), used(eng, P.INT4)))

    eng = engine(mixkv.AgeTierPolicy())
    serve(eng, watch)

    # Young, the request is all FP16; as it ages its old windows move to INT4, layer by layer.
    assert trace[0][2][0] == 0
    int4_blocks = [t[2][0] for t in trace]
    assert int4_blocks == sorted(int4_blocks) and int4_blocks[-1] > int4_blocks[0]
    assert eng.stats().age_demotions == int4_blocks[-1] > 0

    # The same request without tiers holds only FP16 blocks, and more bytes at its end.
    plain = []
    serve(
        engine(mixkv.AgeTierPolicy(enabled=False)), lambda tokens, e: plain.append((used(e, P.FP16), used(e, P.INT4)))
    )
    assert all(p[1][0] == 0 for p in plain)
    tiered_bytes = trace[-1][1][1] + trace[-1][2][1]
    assert tiered_bytes < 0.7 * plain[-1][0][1]


def tiny_smollm2(seed=0):
    """A SmolLM2 of random weights (2 layers, GQA 2:1, head_dim 64): the
    NumPy model of examples/smollm2 without its GGUF."""
    import model as smollm2

    rng = np.random.default_rng(seed)
    c = smollm2.Config(
        num_layers=2,
        hidden=128,
        ffn=256,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        rope_theta=10000.0,
        rms_eps=1e-5,
        vocab=64,
    )

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    m = object.__new__(smollm2.SmolLM2)
    m.config = c
    m.embedding = (0.1 * rng.standard_normal((c.vocab, c.hidden))).astype(np.float32)
    m.output_norm = np.ones(c.hidden, dtype=np.float32)
    m.output = m.embedding
    m.layers = [
        smollm2.Layer(
            attn_norm=np.ones(c.hidden, dtype=np.float32),
            wq=4 * w(c.num_heads * c.head_dim, c.hidden),
            wk=4 * w(c.num_kv_heads * c.head_dim, c.hidden),
            wv=w(c.num_kv_heads * c.head_dim, c.hidden),
            wo=w(c.hidden, c.num_heads * c.head_dim),
            ffn_norm=np.ones(c.hidden, dtype=np.float32),
            w_gate=w(c.ffn, c.hidden),
            w_up=w(c.ffn, c.hidden),
            w_down=w(c.hidden, c.ffn),
        )
        for _ in range(c.num_layers)
    ]
    m.inv_freq = c.rope_theta ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
    return m


def test_default_policy_replay_in_one_chunk_matches_the_engine():
    """examples/smollm2/policy_grid.py scores age tiers in one causal chunk
    instead of a decode step a token; with the default policy's INT4 floor
    (and INT2 in one layer) its log-probabilities and bytes are the
    engine's, including the windows of fed tokens that age while it runs."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "smollm2"))
    import age_tiers_eval as ate
    import policy_grid as pg

    m = tiny_smollm2()
    rng = np.random.default_rng(3)
    prompt = [int(x) for x in rng.integers(0, m.config.vocab, 200)]
    fed = [int(x) for x in rng.integers(0, m.config.vocab, 171)]  # window 6 (prompt and fed rows) ages at token 152
    _, ks, vs, _ = m.prefill(prompt)
    bytes_of = ate.block_bytes(m.config.num_kv_heads, m.config.head_dim)
    for floors in ([P.INT4, P.INT4], [P.INT4, P.INT2]):
        chunk_fp16 = pg.scored(pg.tiered_logits(m, ks, vs, fed[:-1], len(prompt), [P.FP16, P.FP16]), fed)["_logp"]
        chunk = pg.scored(pg.tiered_logits(m, ks, vs, fed[:-1], len(prompt), floors), fed)["_logp"]
        rec = ate.run_request(m, [ate.Variant("FP16"), ate.Variant("tiers", floors=floors)], prompt, fed, ks, vs)
        engine_fp16, engine = np.asarray(rec[0]["logp"]), np.asarray(rec[1]["logp"])
        effect = engine - engine_fp16
        # The tiers move log-probabilities by up to 2.5 here; the chunk and the
        # engine (which rounds each attention output to float16) agree within
        # 0.03, and ageing one token early or late already misses by 0.06-0.11.
        assert np.abs(effect).max() > 0.5
        assert np.abs((chunk - chunk_fp16) - effect).max() < 0.03
        assert np.abs(chunk - engine).max() < 0.03
        assert rec[1]["bytes"][-1] / rec[0]["bytes"][-1] == ate.predicted_ratio(
            len(prompt) + len(fed) - 1, floors, bytes_of
        )
