"""mixkv.Engine driven as a serving engine drives it: mixed text-only and
video requests with string ids, forks (parallel sampling), finish on EOS,
cancel, a rejected request, and a cache tight enough to force swaps,
demotions and preemptions, with a deterministic tiny "model": every K/V/Q
row is a seeded hash of (request, position, layer, token), the next token
the argmax of the attention outputs through a fixed matrix plus a seeded
per-request perturbation (parallel samples diverge). Invariants hold after
every step; requests whose windows stayed FP16 choose the same tokens as in
a roomy cache; the CUDA backend, where it can run, chooses the same tokens
as the CPU backend for them."""

import importlib.util
import math
import zlib

import mixkv
import numpy as np
import pytest
from mixkv import Precision, RequestState, Segment, TokenKind, TokenLayout

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16
VOCAB, HIDDEN, EOS = 16, 48, 0
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
SLAB = 32 << 10  # 4 FP16 blocks


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def row(kind, root, position, layer, token, heads):
    """One token's K, V or Q row: float16 [heads, HEAD_DIM]."""
    return seeded(kind, root, position, layer, token).standard_normal((heads, HEAD_DIM)).astype(np.float16)


READOUT = [
    seeded("readout", layer).standard_normal((Q_HEADS * HEAD_DIM, VOCAB)).astype(np.float32) for layer in range(LAYERS)
]


def sample(key, position, outs):
    """The next token from one row's attention outputs of every layer (float16 [Q_HEADS, HEAD_DIM])."""
    logits = sum(o.astype(np.float32).reshape(-1) @ w for o, w in zip(outs, READOUT))
    logits = logits + 4.0 * seeded("noise", key, position).standard_normal(VOCAB)
    logits[EOS] -= 4.0  # EOS rarer than other tokens: requests live long enough to fork and to fill the cache
    return int(np.argmax(logits))


def dense_attention(q, ks, vs):
    """The engine's own prefill attention for one query row: q [Q_HEADS, D], ks/vs [tokens, KV_HEADS, D]."""
    group = Q_HEADS // KV_HEADS
    k = np.repeat(ks.astype(np.float64), group, axis=1)
    v = np.repeat(vs.astype(np.float64), group, axis=1)
    s = np.einsum("hd,thd->ht", q.astype(np.float64), k) / math.sqrt(HEAD_DIM)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v)).astype(np.float16)


class Workload:
    """The requests: (arrival step, id, kind, prompt tokens, max new tokens, plan)."""

    def __init__(self, with_reject=True):
        self.requests = []
        for i in range(6):
            self.requests.append(dict(arrival=i, id=f"text-{i}", prompt=20 + 7 * i, new=22 + 2 * i, kind="text"))
        for i in range(4):
            # (text 8, visual 4-6 windows, text 6); even ones planned from embeddings, odd ones all FP16.
            visual = BLOCK * (4 + i % 3)
            layout = TokenLayout(
                [Segment(TokenKind.Text, 8), Segment(TokenKind.Visual, visual), Segment(TokenKind.Text, 6)]
            )
            self.requests.append(
                dict(arrival=1 + 2 * i, id=f"video-{i}", layout=layout, new=20, kind="video", planned=i % 2 == 0)
            )
        self.requests.append(dict(arrival=3, id=1234, prompt=33, new=8, kind="text"))  # an int id among the strings
        if with_reject:
            self.requests.append(dict(arrival=2, id="huge", prompt=20000, new=4, kind="text"))
        self.forks = {"text-1": "text-1/b", "video-1": "video-1/b", "text-4": "text-4/b"}
        self.cancel_after = {"text-5": 3}  # cancel once it generated this many tokens


def embeddings_of(request):
    n = request["layout"].num_tokens
    e = seeded("embed", request["id"]).standard_normal((n, HIDDEN)).astype(np.float32)
    e[:, 0] += 2.0  # a shared direction, so that cosines spread
    return e


PLANNER = mixkv.PlannerConfig([0.9] * LAYERS, window_size=BLOCK)


def run(
    backend="cpu", arena_slabs=64, preemption=mixkv.PreemptionMode.Swap, workload=None, to_device=None, from_device=None
):
    """The serving loop. Returns (tokens by request, requests whose windows
    left FP16, step reports, the engine, each child's parent's generated count
    at its fork)."""
    workload = workload or Workload()
    to_device = to_device or (lambda a: a)
    from_device = from_device or (lambda a: a)
    config = mixkv.CacheConfig(SHAPE, arena_slabs * SLAB, SLAB, swap_blocks=[256, 256, 256], fp16_windows_first=True)
    engine = mixkv.Engine(
        config,
        mixkv.SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96, preemption=preemption),
        num_q_heads=Q_HEADS,
        backend=backend,
        planner=PLANNER,
    )
    tokens, root, quantized, reports = {}, {}, set(), []
    requests = sorted(workload.requests, key=lambda r: r["arrival"])
    fork_at = {}  # child -> tokens the parent had generated when it was forked
    step_no = 0
    while requests or engine.has_unfinished():
        while requests and requests[0]["arrival"] <= step_no:
            r = requests.pop(0)
            if r["kind"] == "text":
                engine.add_request(r["id"], r["prompt"], max_new_tokens=r["new"], arrival_time=step_no)
                n = r["prompt"]
            else:
                n = r["layout"].num_tokens
                if r["planned"]:
                    engine.add_request(
                        r["id"], r["layout"], embeddings=embeddings_of(r), max_new_tokens=r["new"], arrival_time=step_no
                    )
                else:
                    engine.add_request(r["id"], r["layout"], max_new_tokens=r["new"], arrival_time=step_no)
            root[r["id"]] = r["id"]
            tokens[r["id"]] = [int(t) for t in seeded("prompt", r["id"]).integers(1, VOCAB, n)]
        step_no += 1
        step = engine.step()
        engine.check_invariants()
        reports.append(step)
        assert step.prefill_rows == sum(p.end - p.start for p in step.prefills)

        # Prefill: every chunk's rows, concatenated, one store a layer.
        positions = [(p.request_id, pos) for p in step.prefills for pos in range(p.start, p.end)]
        for p in step.prefills:
            assert p.end <= len(tokens[p.request_id])
        for layer in range(LAYERS):
            k = (
                np.stack([row("k", root[i], pos, layer, tokens[i][pos], KV_HEADS) for i, pos in positions])
                if positions
                else np.zeros((0, KV_HEADS, HEAD_DIM), np.float16)
            )
            v = (
                np.stack([row("v", root[i], pos, layer, tokens[i][pos], KV_HEADS) for i, pos in positions])
                if positions
                else np.zeros((0, KV_HEADS, HEAD_DIM), np.float16)
            )
            engine.store(layer, to_device(k), to_device(v))
        for p in step.prefills:
            if p.last:  # the prompt is complete: sample from its last row (dense attention, exact K/V)
                i, last = p.request_id, p.end - 1
                assert p.end == len(tokens[i])
                outs = []
                for layer in range(LAYERS):
                    ks = np.stack([row("k", root[i], t, layer, tokens[i][t], KV_HEADS) for t in range(p.end)])
                    vs = np.stack([row("v", root[i], t, layer, tokens[i][t], KV_HEADS) for t in range(p.end)])
                    outs.append(dense_attention(row("q", root[i], last, layer, tokens[i][last], Q_HEADS), ks, vs))
                tokens[i].append(sample(i, p.end, outs))

        # Decode: the batch in step.decodes order.
        if step.decodes:
            outs = []
            for layer in range(LAYERS):
                rows = [(i, len(tokens[i]) - 1) for i in step.decodes]
                q = np.stack([row("q", root[i], pos, layer, tokens[i][pos], Q_HEADS) for i, pos in rows])
                k = np.stack([row("k", root[i], pos, layer, tokens[i][pos], KV_HEADS) for i, pos in rows])
                v = np.stack([row("v", root[i], pos, layer, tokens[i][pos], KV_HEADS) for i, pos in rows])
                out = engine.attend(layer, to_device(q), to_device(k), to_device(v))
                outs.append(from_device(out))
            for b, i in enumerate(step.decodes):
                tokens[i].append(sample(i, len(tokens[i]), [o[b] for o in outs]))

        for i in list(tokens):
            if i in engine and engine.cache.holds(i) and not engine.cache.is_swapped(i):
                plan = engine.cache.plan(i)
                if any(plan.window_counts(layer)[0] != plan.num_windows for layer in range(LAYERS)):
                    quantized.add(i)
        # The engine's decisions: EOS, forks, a cancel.
        for i in list(step.decodes) + [p.request_id for p in step.prefills if p.last]:
            if tokens[i][-1] == EOS and i in engine:
                engine.finish(i)
        for parent, child in workload.forks.items():
            if parent not in engine or child in fork_at:
                continue
            status = engine.status(parent)  # state Finished once it ended, until the next step reports it
            new = next(r["new"] for r in workload.requests if r["id"] == parent)
            if status.state == RequestState.Running and 2 <= status.generated < new and tokens[parent][-1] != EOS:
                try:
                    engine.fork(parent, child)
                except mixkv.OutOfMemory as e:  # every page-table slot taken: try again at the next step
                    assert "max_num_seqs" in str(e) and child not in engine
                    continue
                fork_at[child] = status.generated
                root[child] = root[parent]
                tokens[child] = list(tokens[parent])
                if parent in quantized:
                    quantized.add(child)
        for i, n in workload.cancel_after.items():
            if i in engine and engine.status(i).state != RequestState.Finished and engine.status(i).generated >= n:
                assert engine.cancel(i)
        assert step_no < 2000
    engine.check_invariants()
    for p in mixkv.Precision:
        assert engine.cache.pool_stats(p).used_blocks == 0
    return tokens, quantized, reports, engine, fork_at


def fp16_matches(a, b, workload):
    """Requests whose windows stayed FP16 in both runs (and, for a fork, that
    were forked at the same point) with their generated tokens in each run.
    text-5 is cancelled after a number of tokens, either way."""
    ga, gb = generated(a[0], workload), generated(b[0], workload)
    same = [
        i
        for i in ga
        if i in gb and i not in a[1] and i not in b[1] and i != "text-5" and a[4].get(i, -1) == b[4].get(i, -1)
    ]
    return {i: (ga[i], gb[i]) for i in same}


def report_sets(reports):
    finished = {f.request_id: f for s in reports for f in s.finished}
    rejected = {r.request_id: r for s in reports for r in s.rejected}
    return finished, rejected


def generated(tokens, workload):
    """The generated part of each request's tokens."""
    lengths = {r["id"]: (r["prompt"] if r["kind"] == "text" else r["layout"].num_tokens) for r in workload.requests}
    for parent, child in workload.forks.items():
        lengths[child] = lengths[parent]
    return {i: t[lengths[i] :] for i, t in tokens.items()}


@pytest.fixture(scope="module")
def roomy():
    return run(arena_slabs=256)


@pytest.fixture(scope="module")
def tight():
    return run(arena_slabs=12)


def test_engine_loop_reports_every_request(roomy):
    tokens, _, reports, engine, fork_at = roomy
    w = Workload()
    finished, rejected = report_sets(reports)
    assert set(rejected) == {"huge"} and rejected["huge"].reason
    expected = {r["id"] for r in w.requests} - {"huge"} | set(w.forks.values())
    assert set(finished) == expected
    assert finished["text-5"].reason == mixkv.FinishReason.Cancelled
    assert finished[1234].request_id == 1234  # the caller's int id comes back as it was given
    got = generated(tokens, w)
    for r in w.requests:
        f = finished.get(r["id"])
        if f is None or f.reason == mixkv.FinishReason.Cancelled:
            continue
        assert f.generated == len(got[r["id"]])
        if f.reason == mixkv.FinishReason.Length:
            assert f.generated == r["new"] and EOS not in got[r["id"]][:-1]
        else:
            assert f.reason == mixkv.FinishReason.Stopped and got[r["id"]][-1] == EOS
    assert fork_at == {child: 2 for child in w.forks.values()}
    for parent, child in w.forks.items():  # children share the parent's first tokens, then diverge
        assert got[child][:2] == got[parent][:2] and got[child] != got[parent]
    stats = engine.stats()
    assert stats.rejected == 1 and stats.cancelled == 1
    # Every id can be used again once its request has been reported.
    assert "text-0" not in engine
    assert not engine.finish("text-0")


def test_tight_cache_swaps_demotes_and_keeps_fp16_tokens(roomy, tight):
    tokens, quantized, reports, engine, fork_at = tight
    stats = engine.stats()
    assert stats.preempted_swap > 0
    assert stats.demotions > 0
    assert any(s.swapped_out for s in reports) and any(s.swapped_in for s in reports)
    w = Workload()
    same = fp16_matches(tight, roomy, w)
    assert {"text-0", "text-1", "text-1/b", "text-4/b", 1234} <= set(same)
    for i, (g, rg) in same.items():
        assert g == rg, i
    assert len(generated(tokens, w)["text-5"]) >= 3


def test_recompute_preemption_keeps_fp16_tokens(roomy):
    recompute = run(arena_slabs=12, preemption=mixkv.PreemptionMode.Recompute)
    reports, engine = recompute[2], recompute[3]
    assert engine.stats().preempted_recompute > 0
    assert any(s.preempted for s in reports)
    same = fp16_matches(recompute, roomy, Workload())
    assert {"text-0", "text-1", 1234} <= set(same)
    for i, (g, rg) in same.items():
        assert g == rg, i


def small_engine(num_q_heads=Q_HEADS, **kw):
    config = mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB)
    return mixkv.Engine(config, num_q_heads=num_q_heads, **kw)


def test_attend_allocates_float16_like_q_and_fills_lse():
    engine = small_engine()
    engine.add_request("a", 40, max_new_tokens=4)
    step = engine.step()
    assert step.prefills == [mixkv.Prefill("a", 0, 40, True)] and step.prefill_rows == 40
    k = seeded("k").standard_normal((40, KV_HEADS, HEAD_DIM)).astype(np.float16)
    for layer in range(LAYERS):
        engine.store(layer, k, k)
    step = engine.step()
    assert step.decodes == ["a"] and step.prefills == []
    q = seeded("q").standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
    kv = k[:1].copy()
    out = engine.attend(0, q, kv, kv)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == (1, Q_HEADS, HEAD_DIM)
    lse = np.full((1, Q_HEADS), np.nan, np.float32)
    out2 = np.empty_like(out)
    assert engine.attend(1, q, kv, kv, out=out2, lse=lse) is out2
    assert np.isfinite(lse).all()
    # The keys attended are the 40 stored rows and the appended one: check against dense attention.
    keys = np.concatenate([k, kv])
    np.testing.assert_allclose(
        out[0].astype(np.float32), dense_attention(q[0], keys, keys).astype(np.float32), rtol=2e-3, atol=2e-3
    )


def test_errors_name_the_argument_and_change_nothing():
    engine = small_engine()
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine: num_q_heads = 0: expected >= 1"):
        small_engine(num_q_heads=0)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine: backend: expected 'cpu' or 'cuda', got 'tpu'"):
        small_engine(backend="tpu")
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine: cache_config: expected a mixkv.CacheConfig"):
        mixkv.Engine(SHAPE, num_q_heads=4)
    with pytest.raises(mixkv.InvalidArgument, match=r"num_q_heads = 3: expected a positive multiple"):
        small_engine(num_q_heads=3)
    if not mixkv.built_with_cuda:
        with pytest.raises(mixkv.InvalidArgument, match=r"backend: 'cuda' needs mixkv built with CUDA"):
            small_engine(backend="cuda")

    engine.add_request("a", 40, max_new_tokens=4)
    before = engine.describe_state()
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.add_request: request_id = 'a': already a live request"):
        engine.add_request("a", 10, max_new_tokens=1)
    with pytest.raises(mixkv.InvalidArgument, match=r"request_id: expected a str or an int, got float"):
        engine.add_request(1.5, 10, max_new_tokens=1)
    with pytest.raises(mixkv.InvalidArgument, match=r"request_id: expected a str or an int, got bool"):
        engine.add_request(True, 10, max_new_tokens=1)
    with pytest.raises(mixkv.InvalidArgument, match=r"layout_or_num_tokens = 0: expected >= 1"):
        engine.add_request("b", 0, max_new_tokens=1)
    with pytest.raises(mixkv.InvalidArgument, match=r"layout_or_num_tokens: expected a mixkv.TokenLayout"):
        engine.add_request("b", [1, 2], max_new_tokens=1)
    with pytest.raises(mixkv.InvalidArgument, match=r"max_new_tokens = 0: expected >= 1"):
        engine.add_request("b", 10, max_new_tokens=0)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"embeddings: expected a C-contiguous float32, float16 or "
        r"bfloat16 array on cpu, got int32",
    ):
        engine.add_request("b", 10, embeddings=np.zeros((10, 8), np.int32), max_new_tokens=1)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"embeddings: expected a 2-D array \[num_tokens, hidden\], "
        r"got shape \(10,\)",
    ):
        engine.add_request("b", 10, embeddings=np.zeros(10, np.float32), max_new_tokens=1)
    with pytest.raises(ValueError):  # embeddings without a planner: the scheduler's own check
        engine.add_request("b", 10, embeddings=np.zeros((10, 8), np.float32), max_new_tokens=1)
    with pytest.raises(mixkv.UnknownId, match=r"Engine.fork: parent_id = 'zz': not a live request"):
        engine.fork("zz", "c")
    with pytest.raises(mixkv.UnknownId, match=r"Engine.finish: request_id = 'zz': never added"):
        engine.finish("zz")
    with pytest.raises(mixkv.UnknownId, match=r"Engine.status: request_id = 7: not a live request"):
        engine.status(7)
    with pytest.raises(mixkv.UnknownId, match=r"Engine.cache.plan: request_id = 'zz'"):
        engine.cache.plan("zz")
    with pytest.raises(ValueError, match=r"not Running|Running"):  # the scheduler's: the parent is still waiting
        engine.fork("a", "c")
    assert engine.describe_state() == before and "b" not in engine and "c" not in engine
    engine.check_invariants()

    step = engine.step()
    k = np.zeros((step.prefill_rows, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"Engine.store: k: expected a C-contiguous float16 array on cpu, "
        r"got float32",
    ):
        engine.store(0, k.astype(np.float32), k)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"Engine.store: v: expected a C-contiguous float16 array on cpu, "
        r"got a non-contiguous array",
    ):
        engine.store(0, k, np.zeros((step.prefill_rows, HEAD_DIM, KV_HEADS), np.float16).transpose(0, 2, 1))
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::store: k: expected .*shape"):
        engine.store(0, k[:-1], k[:-1])
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.store: k: .* got list"):
        engine.store(0, [[1.0]], k)
    with pytest.raises(IndexError):
        engine.store(LAYERS, k, k)
    for layer in range(LAYERS):
        engine.store(layer, k, k)
    step = engine.step()
    assert step.decodes == ["a"]
    q = np.zeros((1, Q_HEADS, HEAD_DIM), np.float16)
    kv = np.zeros((1, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"Engine.attend: q: expected a C-contiguous float16 array on cpu, "
        r"got float32",
    ):
        engine.attend(0, q.astype(np.float32), kv, kv)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"Engine.attend: out: expected a C-contiguous float16 array on "
        r"cpu, got float32",
    ):
        engine.attend(0, q, kv, kv, out=np.zeros((1, Q_HEADS, HEAD_DIM), np.float32))
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.attend: lse: expected a C-contiguous float32 array"):
        engine.attend(0, q, kv, kv, lse=np.zeros((1, Q_HEADS), np.float16))
    readonly = np.zeros((1, Q_HEADS, HEAD_DIM), np.float16)
    readonly.flags.writeable = False
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.attend: out: .*got a read-only array"):
        engine.attend(0, q, kv, kv, out=readonly)
    engine.check_invariants()
    assert engine.attend(0, q, kv, kv).shape == (1, Q_HEADS, HEAD_DIM)
    # A fork of a running request works; the child id must be new.
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.fork: child_id = 'a': already a live request"):
        engine.fork("a", "a")
    engine.fork("a", "a2")
    assert "a2" in engine and engine.status("a2").state == RequestState.Running


def test_cache_view_is_read_only_and_speaks_caller_ids():
    engine = small_engine()
    engine.add_request("x", 40, max_new_tokens=2)
    engine.step()
    view = engine.cache
    assert view.holds("x") and view.num_tokens("x") == 40
    assert view.pool_stats(Precision.FP16).used_blocks == LAYERS * 3
    assert len(view.blocks("x", 0, Precision.FP16)) == 3
    for name in ("add_sequence", "free_sequence", "fork", "append_tokens", "demote", "swap_out", "swap_in"):
        assert not hasattr(view, name)
    with pytest.raises(AttributeError):
        view.extra = 1


def test_engine_backend_properties():
    engine = small_engine()
    assert engine.backend == "cpu" and engine.device == 0 and engine.num_q_heads == Q_HEADS
    assert engine.config.num_q_heads == Q_HEADS and engine.config.backend == mixkv.BackendKind.CPU
    assert "mixkv.Engine(backend='cpu'" in repr(engine)
    engine.synchronize()


def test_configs_given_are_not_changed():
    cache = mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB)
    sched = mixkv.SchedulerConfig(max_num_seqs=4)
    mixkv.Engine(cache, sched, num_q_heads=Q_HEADS, planner=PLANNER)
    assert sched.planner is None
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine: planner: given twice"):
        mixkv.Engine(cache, mixkv.SchedulerConfig(planner=PLANNER), num_q_heads=Q_HEADS, planner=PLANNER)


# --------------------------------------------------------------------------------------------------------------------
# The CUDA backend: the same loop, the same token choices for FP16 requests.
def cuda_unavailable():
    if not mixkv.built_with_cuda:
        return "mixkv was built without CUDA (MIXKV_CUDA=OFF)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


def test_cuda_backend_chooses_the_cpu_backend_tokens(roomy, tight):
    why = cuda_unavailable()
    if why:
        pytest.skip(why)
    import torch

    def on_cuda(arena_slabs):
        return run(
            backend="cuda",
            arena_slabs=arena_slabs,
            to_device=lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda(),
            from_device=lambda t: t.cpu().numpy(),
        )

    w = Workload()
    cuda_roomy = on_cuda(256)
    assert cuda_roomy[3].backend == "cuda"
    assert cuda_roomy[4] == roomy[4]  # the same schedule, so the same fork points
    same = fp16_matches(cuda_roomy, roomy, w)
    assert {"text-0", "text-1/b", 1234} <= set(same)
    for i, (g, cg) in same.items():
        assert g == cg, i
    # The tight cache on the GPU: swaps and demotions, invariants after every step (inside run).
    cuda_tight = on_cuda(12)
    stats = cuda_tight[3].stats()
    assert stats.preempted_swap > 0 and stats.demotions > 0
    same = fp16_matches(cuda_tight, tight, w)
    assert {"text-0", "text-1", 1234} <= set(same)
    for i, (g, cg) in same.items():
        assert g == cg, i


def test_cuda_attend_allocates_torch_on_the_device():
    why = cuda_unavailable()
    if why:
        pytest.skip(why)
    import torch

    engine = small_engine(backend="cuda")
    engine.add_request("a", 40, max_new_tokens=4)
    step = engine.step()
    k = torch.randn(step.prefill_rows, KV_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    for layer in range(LAYERS):
        engine.store(layer, k, k)
    engine.step()
    q = torch.randn(1, Q_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    kv = torch.randn(1, KV_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    out = engine.attend(0, q, kv, kv)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float16
    lse = torch.empty(1, Q_HEADS, dtype=torch.float32, device="cuda")
    engine.attend(1, q, kv, kv, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all()
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"Engine.attend: q: expected a C-contiguous float16 array on "
        r"cuda:0, got float16 on cpu",
    ):
        engine.attend(0, q.cpu(), kv, kv)
