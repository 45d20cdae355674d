"""The question-aware window score: mixkv.plan_from_layer_scores_within_budget
(the budget rule on per-(layer, window) scores) and the SmolLM2 example's
observation-window attention (examples/smollm2/planning.py), on tiny shapes
without the model."""

import pathlib
import re
import sys
import types

import mixkv
import numpy as np
import pytest
from mixkv import Precision, Segment, TokenKind, TokenLayout

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "smollm2"
core = mixkv
WINDOW = 32


@pytest.fixture(scope="module")
def planning():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import planning

        return planning
    finally:
        sys.path.remove(str(EXAMPLE))


def precisions(plan):
    return [[plan.at(layer, w) for w in range(plan.num_windows)] for layer in range(plan.num_layers)]


# 2 layers, 1 KV head of 16 channels, windows of 16: an INT2 -> INT4 step costs
# 128 bytes, an INT4 -> FP16 step 640 (block bytes 256 / 384 / 1,024).
LAYOUT = TokenLayout([Segment(TokenKind.Text, 4), Segment(TokenKind.Visual, 64), Segment(TokenKind.Text, 3)])
SHAPE = mixkv.CacheShape(2, 1, 16, 16)
SCORES = [[7.0, 1.0, 0.0, 5.0], [7.0, 2.0, 8.0, 0.5]]


def ratio(nbytes):
    full = mixkv.plan_stats(LAYOUT, mixkv.PrecisionPlan(2, 4, Precision.FP16), SHAPE).bytes
    return nbytes / full


def start_bytes():
    plan = mixkv.PrecisionPlan(2, 4, Precision.INT2)
    plan.set(0, 0, Precision.FP16)
    plan.set(1, 0, Precision.FP16)
    return mixkv.plan_stats(LAYOUT, plan, SHAPE).bytes


def test_budget_rule_upgrades_the_largest_scores_first():
    F, I4, I2 = Precision.FP16, Precision.INT4, Precision.INT2
    fitted = core.plan_from_layer_scores_within_budget(LAYOUT, SCORES, SHAPE, ratio(start_bytes() + 3 * 128))
    assert precisions(fitted.plan) == [[F, I2, I2, I4], [F, I4, I4, I2]]
    assert fitted.stats.bytes == start_bytes() + 3 * 128 == mixkv.plan_stats(LAYOUT, fitted.plan, SHAPE).bytes
    # Five INT4 steps, then (1, 2)'s FP16 step (its score 8 is 20x the last INT4 step's 0 ... 0.4 per byte).
    fitted = core.plan_from_layer_scores_within_budget(LAYOUT, SCORES, SHAPE, ratio(start_bytes() + 5 * 128 + 640))
    assert precisions(fitted.plan) == [[F, I4, I2, I4], [F, I4, F, I4]]
    assert fitted.plan.score(2) == pytest.approx(4.0)


def test_budget_rule_takes_a_2d_array_and_its_error_weights():
    # With INT4 as bad as INT2 no INT4 step gains anything; a FP16 step only
    # follows its window's INT4 step, so a 768-byte room buys one INT4 step
    # and then that window's FP16 step only if it fits.
    config = core.ScoreBudgetConfig(int4_error=0.3, int2_error=0.3)
    assert (config.int4_error, config.int2_error, config.first_window_fp16) == (0.3, 0.3, True)
    fitted = core.plan_from_layer_scores_within_budget(
        LAYOUT, np.asarray(SCORES, dtype=np.float32), SHAPE, ratio(start_bytes() + 128 + 640), config
    )
    counts = [fitted.plan.window_counts(layer) for layer in range(2)]
    assert sum(c[0] for c in counts) == 3  # window 0 twice and one upgraded window
    assert fitted.stats.bytes <= start_bytes() + 128 + 640


@pytest.mark.parametrize(
    ("scores", "budget", "config", "message"),
    [
        ([SCORES[0]], 0.3, None, "scores: 1 rows, expected one per layer"),
        ([SCORES[0], [1.0, 2.0]], 0.3, None, "scores[1]: 2 scores, expected one per window"),
        ([SCORES[0], [1.0, 2.0, -1.0, 0.0]], 0.3, None, "scores[1][2] = -1"),
        ([SCORES[0], [1.0, 2.0, float("nan"), 0.0]], 0.3, None, "scores[1][2] = nan"),
        (SCORES, 0.0, None, "budget_ratio = 0"),
        (SCORES, 0.3, dict(int4_error=0.5, int2_error=0.1), "config.int2_error"),
        (SCORES, 0.3, dict(int4_error=-1.0), "config.int4_error"),
    ],
)
def test_budget_rule_rejects_bad_arguments_naming_them(scores, budget, config, message):
    args = [core.ScoreBudgetConfig(**config)] if config else []
    with pytest.raises(ValueError, match=re.escape(message)):
        core.plan_from_layer_scores_within_budget(LAYOUT, scores, SHAPE, budget, *args)


def synthetic_prompt(head, windows, tail):
    n = head + windows * WINDOW + tail
    layout = TokenLayout(
        [Segment(TokenKind.Text, head), Segment(TokenKind.Visual, windows * WINDOW), Segment(TokenKind.Text, tail)]
    )
    return types.SimpleNamespace(ids=list(range(n)), head=list(range(head)), tail=list(range(tail)), layout=layout)


def reference_scores(prompt, ks, queries, num_heads, obs):
    """The observation-window attention mass the slow way, in float64."""
    n = len(prompt.ids)
    n0 = len(prompt.head)
    windows = prompt.layout.num_windows(WINDOW)
    group = num_heads // ks[0].shape[1]
    out = np.zeros((len(ks), windows))
    for layer, (k, q) in enumerate(zip(ks, queries)):
        for h in range(num_heads):
            for r in range(obs):
                row = n - obs + r
                logits = [
                    float(np.dot(q[q.shape[0] - obs + r, h].astype(np.float64), k[j, h // group].astype(np.float64)))
                    / np.sqrt(k.shape[2])
                    for j in range(row + 1)
                ]
                p = np.exp(np.asarray(logits) - max(logits))
                p /= p.sum()
                for w in range(windows):
                    out[layer, w] += p[n0 + w * WINDOW : n0 + (w + 1) * WINDOW].sum()
    return out


def test_observation_scores_match_a_slow_reference_and_find_a_planted_window(planning, rng):
    # 3 layers, 6 query heads over 2 KV heads (GQA 3:1), head_dim 8; 5 text,
    # 4 windows, 7 question tokens, 5 of them observed.
    prompt = synthetic_prompt(5, 4, 7)
    n, heads, kv_heads, d, obs = len(prompt.ids), 6, 2, 8, 5
    ks = [rng.standard_normal((n, kv_heads, d)).astype(np.float16) for _ in range(3)]
    queries = [rng.standard_normal((7, heads, d)).astype(np.float32) for _ in range(3)]
    # At layer 1 every observed row of every head points at window 2's keys.
    direction = np.ones(d, dtype=np.float32) / np.sqrt(d)
    ks[1][5 + 2 * WINDOW : 5 + 3 * WINDOW] = (6.0 * direction).astype(np.float16)
    queries[1][:, :, :] = 6.0 * direction
    got = planning.observation_scores(prompt, ks, queries, heads, obs)
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, reference_scores(prompt, ks, queries, heads, obs), rtol=1e-5, atol=1e-6)
    assert np.argmax(got[1]) == 2
    assert np.all(got >= 0) and np.all(got.sum(axis=1) <= obs * heads + 1e-6)
    with pytest.raises(ValueError, match="obs = 8"):
        planning.observation_scores(prompt, ks, queries, heads, 8)

    # The budget rule keeps the planted (layer 1, window 2) above INT2 before
    # anything of lower score.
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=3, num_kv_heads=kv_heads, head_dim=64))
    shape = mixkv.CacheShape(3, kv_heads, 64, WINDOW)
    int2 = mixkv.PrecisionPlan(3, 4, Precision.INT2)
    for layer in range(3):
        int2.set(layer, 0, Precision.FP16)
    stats = mixkv.plan_stats(prompt.layout, int2, shape)
    one_step = stats.bytes + 1.5 * (
        mixkv.BlockFormat(Precision.INT4, kv_heads, 64, WINDOW).block_bytes
        - mixkv.BlockFormat(Precision.INT2, kv_heads, 64, WINDOW).block_bytes
    )
    fitted = planning.scores_within_budget(model, prompt, got, one_step / stats.fp16_bytes)
    upgraded = [(layer, w) for layer in range(3) for w in range(1, 4) if fitted.plan.at(layer, w) != Precision.INT2]
    assert upgraded == [(1, 2)]
