"""The WindowQuant planner through Python: eq. 8 against NumPy, eq. 9, the
precision rule, the batch vote, plan statistics, bad input."""

import mixkv
import numpy as np
import pytest
from helpers import P, layout, make_cache


def normalized_mean(rows):
    rows = rows.astype(np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return np.where(norms > 0, rows / np.where(norms > 0, norms, 1), 0).mean(axis=0)


def eq8(lay, emb, window):
    """Mean cosine over (text token, window token) pairs, per window."""
    text_rows, start = [], 0
    for seg in lay.segments:
        if seg.kind == mixkv.TokenKind.Text:
            text_rows.extend(range(start, start + seg.length))
        start += seg.length
    t = normalized_mean(emb[text_rows])
    return [float(t @ normalized_mean(emb[s : s + window])) for s in lay.window_starts(window)]


def request(rng, frames=4, hidden=48, relevant=2):
    lay = layout(("text", 9), ("visual", frames * 32 + 5), ("text", 7))
    emb = rng.standard_normal((lay.num_tokens, hidden)).astype(np.float32)
    topic = rng.standard_normal(hidden).astype(np.float32)
    emb[:9] += 3 * topic
    emb[-7:] += 3 * topic
    emb[9 + relevant * 32 : 9 + (relevant + 1) * 32] += 4 * topic
    return lay, emb


def config(layers=3, **kwargs):
    return mixkv.PlannerConfig(sensitivities=[0.9, 0.5, 0.1][:layers], **kwargs)


def test_window_similarity_equals_numpy(rng):
    lay, emb = request(rng)
    got = mixkv.window_similarity(lay, emb, 32)
    assert np.allclose(got, eq8(lay, emb, 32), atol=1e-5)
    assert int(np.argmax(got)) == 2
    # float16 embeddings are read as they are.
    half = emb.astype(np.float16)
    assert np.allclose(mixkv.window_similarity(lay, half, 32), eq8(lay, half.astype(np.float32), 32), atol=1e-4)
    lay2, emb2 = request(rng, frames=2)
    batch = mixkv.window_similarity([lay, lay2], [emb, emb2], 32)
    assert len(batch) == 2 and np.allclose(batch[0], got)


def test_plan_follows_the_rule(rng):
    planner = mixkv.WindowPlanner(config())
    assert planner.num_layers == 3
    thresholds = planner.thresholds
    assert all(t.low <= t.high for t in thresholds)
    lay, emb = request(rng)
    plan = planner.plan(lay, emb)
    scores = mixkv.window_similarity(lay, emb, 32)
    assert plan == planner.plan_from_scores(scores)
    assert [plan.score(w) for w in range(4)] == pytest.approx(scores)
    for layer, t in enumerate(thresholds):
        assert plan.at(layer, 0) == P.FP16  # the first window, always
        for w in range(1, 4):
            s = scores[w]
            want = P.FP16 if s > t.high else (P.INT2 if s < t.low else P.INT4)
            assert plan.at(layer, w) == want


def test_min_precision_and_scores():
    planner = mixkv.WindowPlanner(config(layers=2, min_precision=[P.INT4, P.INT2]))
    plan = planner.plan_from_scores([0.9, -1.0, -1.0])
    assert [plan.at(0, w) for w in range(3)] == [P.FP16, P.INT4, P.INT4]
    assert [plan.at(1, w) for w in range(3)] == [P.FP16, P.INT2, P.INT2]


def test_plan_from_layer_scores_decides_each_layer_by_its_row():
    planner = mixkv.WindowPlanner(config(layers=2, min_precision=[P.INT4, P.INT2]))
    rows = np.array([[0.9, -1.0, 2.0], [0.1, 2.0, -1.0]], np.float32)
    plan = planner.plan_from_layer_scores(rows)
    assert [plan.at(0, w) for w in range(3)] == [P.FP16, P.INT4, P.FP16]
    assert [plan.at(1, w) for w in range(3)] == [P.FP16, P.FP16, P.INT2]
    assert [plan.score(w) for w in range(3)] == pytest.approx(rows.mean(axis=0))
    assert planner.plan_from_layer_scores([[0.5, -1.0, 2.0]] * 2) == planner.plan_from_scores([0.5, -1.0, 2.0])
    with pytest.raises(ValueError, match=r"scores.size\(\) = 1, expected one row per layer \(2\)"):
        planner.plan_from_layer_scores([[0.5, 0.5]])
    with pytest.raises(ValueError, match=r"scores\[1\].size\(\) = 1, expected 2 as scores\[0\]"):
        planner.plan_from_layer_scores([[0.5, 0.5], [0.5]])


def test_majority_vote_in_place_and_batch_policy(rng):
    plans = [mixkv.PrecisionPlan(1, 2, P.INT2), mixkv.PrecisionPlan(1, 2, P.INT2), mixkv.PrecisionPlan(1, 3, P.FP16)]
    mixkv.majority_vote(plans)
    assert [plans[2].at(0, w) for w in range(3)] == [P.INT2, P.INT2, P.FP16]
    with pytest.raises(ValueError):
        mixkv.majority_vote([mixkv.PrecisionPlan(1, 1), mixkv.PrecisionPlan(2, 1)])
    with pytest.raises(ValueError, match=r"plans\[0\] is None"):
        mixkv.majority_vote([None])

    requests = [request(rng, relevant=r) for r in (1, 2, 3)]
    lays, embs = [r[0] for r in requests], [r[1] for r in requests]
    voted = mixkv.WindowPlanner(config(batch_policy=mixkv.BatchPolicy.MajorityVote)).plan(lays, embs)
    own = mixkv.WindowPlanner(config()).plan(lays, embs)
    mixkv.majority_vote(own)
    assert voted == own


def test_layer_sensitivity_equals_numpy(rng):
    before = [rng.standard_normal((6, 16)).astype(np.float32) for _ in range(3)]
    after = [b + 0.3 * rng.standard_normal((6, 16)).astype(np.float32) for b in before]
    got = mixkv.layer_sensitivity(before, after)
    want = [float((b.ravel() @ a.ravel()) / np.linalg.norm(b) / np.linalg.norm(a)) for b, a in zip(before, after)]
    assert np.allclose(got, want, atol=1e-6)
    token_mean = mixkv.layer_sensitivity(before, after, mixkv.SensitivityReduction.TokenMean)
    want_tm = [
        float(np.mean(np.sum(b * a, 1) / np.linalg.norm(b, axis=1) / np.linalg.norm(a, axis=1)))
        for b, a in zip(before, after)
    ]
    assert np.allclose(token_mean, want_tm, atol=1e-6)


def test_plan_stats_equal_what_the_manager_allocates(rng):
    planner = mixkv.WindowPlanner(config(layers=2))
    lay, emb = request(rng)
    plan = planner.plan(lay, emb)
    cache = make_cache(num_layers=2)
    stats = mixkv.plan_stats(lay, plan, cache.config.shape)
    assert stats.blocks == cache.demand(lay, plan)
    assert len(stats.layer_blocks) == 2 and stats.compression() >= 1.0
    assert stats.bytes == sum(stats.pool_bytes) and stats.fp16_bytes >= stats.bytes
    cache.add_sequence(1, lay, plan)
    assert [cache.pool_stats(p).used_blocks for p in P] == stats.blocks
    with pytest.raises(ValueError, match="num_windows"):
        mixkv.plan_stats(lay, mixkv.PrecisionPlan(2, 1), cache.config.shape)


def test_floor_layers_within_budget(rng):
    """Whole-layer INT4 floors, most sensitive layer first, within a byte budget."""
    Seg, Kind, Prec = mixkv.Segment, mixkv.TokenKind, mixkv.Precision
    lay = mixkv.TokenLayout([Seg(Kind.Text, 4), Seg(Kind.Visual, 160), Seg(Kind.Text, 3)])
    shape = mixkv.CacheShape(3, 2, 16, 32)

    def plan_with(int4_layers):
        plan = mixkv.PrecisionPlan(3, 5, Prec.INT2)
        for layer in int4_layers:
            for w in range(5):
                plan.set(layer, w, Prec.INT4)
        return plan

    def ratio(plan):
        stats = mixkv.plan_stats(lay, plan, shape)
        return stats.bytes / stats.fp16_bytes

    plan = plan_with([])
    budget = 0.5 * (ratio(plan_with([2])) + ratio(plan_with([2, 0])))
    fitted = mixkv.floor_layers_within_budget(lay, plan, shape, np.array([2, 0, 1]), Prec.INT4, budget)
    assert fitted.floored_layers == [2]
    assert fitted.plan == plan_with([2]) and plan == plan_with([])
    assert fitted.stats.bytes == mixkv.plan_stats(lay, plan_with([2]), shape).bytes
    with pytest.raises(ValueError, match="budget_ratio"):
        mixkv.floor_layers_within_budget(lay, plan, shape, [0], Prec.INT4, float("nan"))
    with pytest.raises(ValueError, match=r"layer_order\[1\] = 0: listed twice"):
        mixkv.floor_layers_within_budget(lay, plan, shape, [0, 0], Prec.INT4, 1.0)


def test_bad_planner_input(rng):
    with pytest.raises(ValueError, match="alpha"):
        mixkv.WindowPlanner(config(alpha=0.0))
    with pytest.raises(ValueError, match="sensitivities"):
        mixkv.WindowPlanner(mixkv.PlannerConfig(sensitivities=[]))
    with pytest.raises(ValueError, match="min_precision"):
        mixkv.WindowPlanner(config(min_precision=[P.INT4]))
    planner = mixkv.WindowPlanner(config())
    lay, emb = request(rng)
    with pytest.raises(ValueError, match="plan: embeddings: expected dtype float32, float16 or bfloat16, got float64"):
        planner.plan(lay, emb.astype(np.float64))
    with pytest.raises(ValueError, match="plan: embeddings: expected shape"):
        planner.plan(lay, emb[None])
    with pytest.raises(ValueError, match=r"plan: embeddings\[1\]: expected a C-contiguous"):
        planner.plan([lay, lay], [emb, np.asfortranarray(emb)])
    with pytest.raises(ValueError, match="embeddings"):
        planner.plan(lay, emb[:-1])
    bad = emb.copy()
    bad[20, 3] = np.inf
    with pytest.raises(ValueError, match="row 20"):
        planner.plan(lay, bad)
    with pytest.raises(ValueError, match="text"):
        mixkv.window_similarity(layout(("visual", 64)), emb[:64], 32)
    with pytest.raises(ValueError, match="score"):
        planner.plan_from_scores([0.5, float("nan")])
