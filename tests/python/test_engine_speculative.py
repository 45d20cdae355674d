"""Speculative decoding through mixkv.Engine, as a serving engine does it:
speculate (or the config's default) -> step (decode_rows) -> attend with
each request's last sampled token and its drafts -> accept. A seeded tiny
"model": every Q/K/V row is a hash of (request, position, layer, token);
drafts are seeded tokens, the accepted count a seeded choice (sometimes no
accept() at all, which the next step treats as none accepted). Every output
row is held to a float64 attention over the request's tokens so far plus
the step's rows up to it (causal), so a rejected draft left in the cache,
or a row read from the wrong slot, shows. The CUDA backend, where it can
run, gives the CPU backend's outputs within 2e-3."""

import importlib.util
import math
import zlib

import mixkv
import numpy as np
import pytest

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16  # a built CUDA instance
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
SLAB = 32 << 10
VOCAB = 50
TOLERANCE = 2e-3
# id: (prompt tokens, max_new_tokens)
REQUESTS = {"a": (20, 14), "b": (37, 11), 7: (9, 16)}


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def row(kind, request, position, layer, token):
    heads = Q_HEADS if kind == "q" else KV_HEADS
    return seeded(kind, request, position, layer, token).standard_normal((heads, HEAD_DIM)).astype(np.float16)


def attention(q, ks, vs):
    """float64 attention of one row q [Q_HEADS, D] over ks, vs [tokens, KV_HEADS, D]."""
    group = Q_HEADS // KV_HEADS
    k = np.repeat(np.asarray(ks, np.float64), group, axis=1)
    v = np.repeat(np.asarray(vs, np.float64), group, axis=1)
    s = np.einsum("hd,thd->ht", q.astype(np.float64), k) / math.sqrt(HEAD_DIM)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v)


def make_engine(backend="cpu", drafts=2):
    return mixkv.Engine(
        mixkv.CacheConfig(SHAPE, 64 * SLAB, SLAB),
        mixkv.SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, num_speculative_tokens=drafts),
        num_q_heads=Q_HEADS,
        backend=backend,
    )


def run(backend="cpu", to_device=None, from_device=None):
    """The loop; returns ([(step, request, out rows)], tokens by request, finished reports, engine)."""
    to_device = to_device or (lambda a: a)
    from_device = from_device or (lambda a: a)
    engine = make_engine(backend)
    tokens = {}
    for i, (n, new) in REQUESTS.items():
        engine.add_request(i, n, max_new_tokens=new)
        tokens[i] = [int(t) for t in seeded("prompt", i).integers(1, VOCAB, n)]
    records, finished = [], {}
    # Ask for more drafts than the default for one step of "b" (speculate before its first decode).
    engine.speculate("b", 5)
    asked = {"b": 5}
    while engine.has_unfinished():
        step = engine.step()
        engine.check_invariants()
        for f in step.finished:
            finished[f.request_id] = f
        if step.prefills:  # the prompt's K/V (the model's own prefill attention is not checked here)
            prompt_rows = [(p.request_id, t) for p in step.prefills for t in range(p.start, p.end)]
            for layer in range(LAYERS):
                k, v = (np.stack([row(kind, i, t, layer, tokens[i][t]) for i, t in prompt_rows]) for kind in "kv")
                engine.store(layer, to_device(k), to_device(v))
            for p in step.prefills:
                if p.last:
                    tokens[p.request_id].append(int(seeded("sample", p.request_id, p.end).integers(1, VOCAB)))
        if not step.decodes:
            continue
        counts = np.diff(step.decode_rows).tolist() if step.decode_rows else [1] * len(step.decodes)
        assert step.num_decode_rows == sum(counts)
        # Each decode's rows: its last sampled token, then its drafts, at consecutive positions.
        batch = []
        for i, n in zip(step.decodes, counts):
            status = engine.status(i)
            assert status.drafts == n - 1
            # status.generated counts the step's sampled token: the drafts fit what is left after it.
            assert status.generated + n - 1 <= REQUESTS[i][1]
            if i in asked:
                assert n - 1 == min(asked.pop(i), REQUESTS[i][1] - status.generated)
            drafts = [int(t) for t in seeded("draft", i, step.step).integers(1, VOCAB, n - 1)]
            first = len(tokens[i]) - 1
            batch.append((i, [(first + j, t) for j, t in enumerate([tokens[i][-1]] + drafts)]))
        outs = []
        for layer in range(LAYERS):
            q, k, v = (
                np.stack([row(kind, i, pos, layer, t) for i, rows in batch for pos, t in rows])
                for kind in ("q", "k", "v")
            )
            out = engine.attend(layer, to_device(q), to_device(k), to_device(v))
            out = from_device(out)
            assert out.shape == (step.num_decode_rows, Q_HEADS, HEAD_DIM) and out.dtype == np.float16
            outs.append(out)
        r = 0
        for i, rows in batch:
            got = np.stack([o[r : r + len(rows)] for o in outs], axis=1)  # [rows, LAYERS, Q_HEADS, D]
            records.append((step.step, i, got))
            for layer in range(LAYERS):
                cached = [(t, tok) for t, tok in enumerate(tokens[i][:-1])]
                ks = [row("k", i, t, layer, tok) for t, tok in cached]
                vs = [row("v", i, t, layer, tok) for t, tok in cached]
                for j, (pos, t) in enumerate(rows):
                    ks.append(row("k", i, pos, layer, t))
                    vs.append(row("v", i, pos, layer, t))
                    want = attention(row("q", i, pos, layer, t), ks, vs)
                    np.testing.assert_allclose(
                        got[j, layer].astype(np.float64), want, rtol=0, atol=TOLERANCE, err_msg=f"{i} row {j}"
                    )
            r += len(rows)
            # Verification: accept a seeded number of drafts, then the token sampled after them.
            drafts = [t for _, t in rows[1:]]
            accepted = int(seeded("accept", i, step.step).integers(0, len(drafts) + 1))
            if drafts and (accepted > 0 or seeded("skip", i, step.step).random() < 0.5):
                engine.accept(i, accepted)
                assert engine.status(i).drafts == 0
            tokens[i] += drafts[:accepted]
            tokens[i].append(int(seeded("sample", i, len(tokens[i])).integers(1, VOCAB)))
        if step.step == 4 and "a" in engine:
            engine.speculate("a", 0)  # one plain step for "a"
            asked["a"] = 0
    engine.check_invariants()
    for p in mixkv.Precision:
        assert engine.cache.pool_stats(p).used_blocks == 0
    return records, tokens, finished, engine


@pytest.fixture(scope="module")
def cpu_run():
    return run()


def test_drafts_are_verified_through_the_cache_and_accepted(cpu_run):
    records, tokens, finished, engine = cpu_run
    assert set(finished) == set(REQUESTS)
    for i, (n, new) in REQUESTS.items():
        assert finished[i].reason == mixkv.FinishReason.Length
        assert finished[i].generated == new == len(tokens[i]) - n
    assert any(out.shape[0] > 1 for _, _, out in records)  # multi-row decodes happened
    stats = engine.stats()
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.draft_tokens == sum(out.shape[0] - 1 for _, _, out in records)


def test_engine_speculative_errors_name_the_argument_and_change_nothing():
    engine = make_engine(drafts=2)
    engine.add_request("a", 20, max_new_tokens=10)
    with pytest.raises(mixkv.UnknownId, match=r"Engine.speculate: request_id = 'zz': not a live request"):
        engine.speculate("zz", 1)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.speculate: num_drafts = -1: expected >= 0"):
        engine.speculate("a", -1)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.speculate: num_drafts: expected an int, got float"):
        engine.speculate("a", 1.5)
    with pytest.raises(mixkv.UnknownId, match=r"Engine.accept: request_id = 3: not a live request"):
        engine.accept(3, 0)
    step = engine.step()
    k = np.zeros((step.prefill_rows, KV_HEADS, HEAD_DIM), np.float16)
    for layer in range(LAYERS):
        engine.store(layer, k, k)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.accept\(request_id='a', num_accepted=0\): .*no draft"):
        engine.accept("a", 0)
    step = engine.step()
    assert step.decode_rows == [0, 3] and step.num_decode_rows == 3
    before = engine.describe_state()
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.accept: num_accepted = -1: expected >= 0"):
        engine.accept("a", -1)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.accept\(request_id='a', num_accepted=3\): num_accepted"):
        engine.accept("a", 3)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.accept: num_accepted: expected an int, got bool"):
        engine.accept("a", True)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.fork\(parent_id='a', child_id='a2'\): .*draft"):
        engine.fork("a", "a2")
    # attend takes the step's rows: one a decode plus its drafts.
    q1 = np.zeros((1, Q_HEADS, HEAD_DIM), np.float16)
    kv1 = np.zeros((1, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::attend: q: expected .*shape \(3, 4, 64\)"):
        engine.attend(0, q1, kv1, kv1)
    assert engine.describe_state() == before and "a2" not in engine
    q = np.zeros((3, Q_HEADS, HEAD_DIM), np.float16)
    kv = np.zeros((3, KV_HEADS, HEAD_DIM), np.float16)
    lse = np.full((3, Q_HEADS), np.nan, np.float32)
    for layer in range(LAYERS):
        assert engine.attend(layer, q, kv, kv, lse=lse).shape == (3, Q_HEADS, HEAD_DIM)
    assert np.isfinite(lse).all()
    engine.accept("a", 2)
    assert engine.status("a").generated == 4 and engine.cache.num_tokens("a") == 23
    engine.fork("a", "a2")  # no drafts awaiting: the fork goes ahead
    engine.check_invariants()


# --------------------------------------------------------------------------------------------------------------------
# The CUDA backend: the same loop, the CPU backend's outputs within 2e-3.
def cuda_unavailable():
    if not mixkv.built_with_cuda:
        return "mixkv was built without CUDA (MIXKV_CUDA=OFF)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


def test_cuda_drafts_match_the_cpu_backend(cpu_run):
    why = cuda_unavailable()
    if why:
        pytest.skip(why)
    import torch

    records, tokens, finished, engine = run(
        backend="cuda",
        to_device=lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda(),
        from_device=lambda t: t.cpu().numpy(),
    )
    assert engine.backend == "cuda" and tokens == cpu_run[1]
    assert [(s, i, o.shape) for s, i, o in records] == [(s, i, o.shape) for s, i, o in cpu_run[0]]
    for (s, i, got), (_, _, want) in zip(records, cpu_run[0]):
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=0, atol=TOLERANCE, err_msg=f"step {s} {i}"
        )
