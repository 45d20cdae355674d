"""Age tiers (SchedulerConfig.age_tiers) through mixkv.Engine on the CPU
backend: a text-only request's KV shrinks with age, block by block as the
rule says (the first window and the recent ones FP16, older ones at each
layer's tier), decode outputs stay close to FP16 attention, and bad knobs
are named."""

import mixkv
import numpy as np
import pytest
from mixkv import Precision as P

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)


def cache_config():
    return mixkv.CacheConfig(SHAPE, arena_bytes=4 << 20, slab_bytes=32 << 10, fp16_windows_first=True)


def engine(tiers):
    config = mixkv.SchedulerConfig(max_num_batched_tokens=256, watermark=0.0, age_tiers=tiers)
    return mixkv.Engine(cache_config(), config, num_q_heads=Q_HEADS, backend="cpu")


def rows(rng, n, heads):
    return rng.standard_normal((n, heads, HEAD_DIM)).astype(np.float16)


def serve(eng, prompt, max_new, seed=0, watch=None):
    """Runs one text request to its end; returns the decode outputs [(position, layer) -> float16]."""
    rng = np.random.default_rng(seed)
    eng.add_request("r", prompt, max_new_tokens=max_new)
    outs = {}
    while eng.has_unfinished():
        tokens = eng.cache.num_tokens("r") if eng.cache.holds("r") else 0
        running = "r" in eng and eng.status("r").state == mixkv.RequestState.Running
        step = eng.step()
        for layer in range(LAYERS):
            if step.prefill_rows:
                eng.store(layer, rows(rng, step.prefill_rows, KV_HEADS), rows(rng, step.prefill_rows, KV_HEADS))
            if step.decodes:
                q = rows(rng, 1, Q_HEADS)
                outs[(tokens, layer)] = eng.attend(layer, q, rows(rng, 1, KV_HEADS), rows(rng, 1, KV_HEADS))
        eng.check_invariants()
        if watch is not None and running and "r" in step.decodes:
            watch(tokens, step)
    return outs


def old_blocks(tokens, recent, sink=1):
    """Stream blocks at the tier for a text sequence that had `tokens` tokens when the step began."""
    full = [k for k in range(tokens // BLOCK) if tokens - 1 - (k * BLOCK + BLOCK - 1) >= recent * BLOCK]
    return [k for k in full if k >= sink]


def test_text_kv_shrinks_with_age_layer_by_layer():
    tiers = mixkv.AgeTierPolicy(recent_windows=2, layer_floor=[P.INT4, P.INT2])
    eng = engine(tiers)
    seen = []

    def watch(tokens, step):
        aged = len(old_blocks(tokens, 2))
        assert len(eng.cache.blocks("r", 0, P.INT4)) == aged
        assert len(eng.cache.blocks("r", 1, P.INT2)) == aged
        assert len(eng.cache.blocks("r", 0, P.INT2)) == 0 and len(eng.cache.blocks("r", 1, P.INT4)) == 0
        # FP16 keeps the sink, the 2 recent blocks and the open tail (and the new token's block).
        fp16_tokens = tokens + 1 - aged * BLOCK
        assert len(eng.cache.blocks("r", 0, P.FP16)) == -(-fp16_tokens // BLOCK)
        seen.append((tokens, aged))
        stepped.append(step.age_demotions)
        assert step.age_demotions <= step.demotions

    stepped = []
    serve(eng, 40, 120, watch=watch)
    assert seen[0] == (40, 0) and seen[-1] == (158, 6)
    assert eng.stats().age_demotions == 2 * 6 == sum(stepped)
    assert eng.stats().demotions == 0


def test_decode_stays_close_to_fp16_and_quantized_blocks_are_read():
    fp16 = serve(engine(mixkv.AgeTierPolicy(enabled=False)), 40, 100)
    tiered = serve(engine(mixkv.AgeTierPolicy(recent_windows=1)), 40, 100)
    assert fp16.keys() == tiered.keys()
    late = [key for key in fp16 if key[0] >= 80]  # blocks 1.. demoted by then
    diff = max(float(np.abs(fp16[k].astype(np.float32) - tiered[k].astype(np.float32)).max()) for k in late)
    assert 0.0 < diff < 0.1, diff
    early = [key for key in fp16 if key[0] < 48]  # nothing old yet: the same bytes, the same outputs
    for key in early:
        np.testing.assert_array_equal(fp16[key], tiered[key])


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"recent_windows": 0}, "config.age_tiers.recent_windows = 0"),
        ({"sink_windows": -1}, "config.age_tiers.sink_windows = -1"),
        ({"layer_floor": [P.INT4]}, "config.age_tiers.layer_floor has 1 layers, expected 0 or 2"),
    ],
)
def test_bad_knobs_are_named(kwargs, needle):
    with pytest.raises(mixkv.InvalidArgument, match=needle):
        engine(mixkv.AgeTierPolicy(**kwargs))


def test_needs_windows_first():
    config = mixkv.SchedulerConfig(age_tiers=mixkv.AgeTierPolicy())
    cache = mixkv.CacheConfig(SHAPE, arena_bytes=4 << 20, slab_bytes=32 << 10)
    with pytest.raises(mixkv.InvalidArgument, match="fp16_windows_first"):
        mixkv.Engine(cache, config, num_q_heads=Q_HEADS, backend="cpu")


def test_knobs_round_trip():
    tiers = mixkv.AgeTierPolicy(sink_windows=2, recent_windows=3, layer_floor=[P.FP16, P.INT2])
    config = mixkv.SchedulerConfig(age_tiers=tiers)
    assert config.age_tiers.enabled and config.age_tiers.sink_windows == 2 and config.age_tiers.recent_windows == 3
    assert list(config.age_tiers.layer_floor) == [P.FP16, P.INT2]
    assert not mixkv.SchedulerConfig().age_tiers.enabled
