"""Engine.prefill: chunked prefill with attention through the cache. A
text-only request (all FP16) and a video request under a mixed plan are
prefilled in chunks (a small token budget), layer by layer, with seeded
Q/K/V rows; each output row is held to a float64 causal attention over the
rows before it: the exact rows for the text request; for the video request
the rows of earlier chunks as the cache holds them (its INT4/INT2 windows
dequantized, what ops.read_head reads) and the chunk's own rows exact. Then
each request decodes a token through the same cache. NumPy arrays and torch
CPU tensors give the same bits; the CUDA backend, where it can run, gives
the CPU backend's outputs within 2e-3. Bad arrays raise naming the argument
and change nothing."""

import importlib.util
import math
import zlib

import mixkv
import numpy as np
import pytest
from helpers import P, plan_of, read_back_windows
from mixkv import Segment, TokenKind, TokenLayout

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16  # a built CUDA instance
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
SLAB = 32 << 10  # 4 FP16 blocks
BUDGET = 40  # max_num_batched_tokens: each prompt takes several chunks
TOLERANCE = 2e-3

TEXT_TOKENS = 75
VIDEO = TokenLayout([Segment(TokenKind.Text, 8), Segment(TokenKind.Visual, 4 * BLOCK), Segment(TokenKind.Text, 6)])
# Windows at rows 8, 24, 40, 56: window 0 stays FP16, the others are quantized in some layer.
VIDEO_PLAN = [[P.FP16, P.INT4, P.INT2, P.INT4], [P.FP16, P.INT2, P.INT4, P.FP16]]


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rows(kind, request, positions, layer):
    """Q (Q_HEADS) or K/V (KV_HEADS) rows of `request` at `positions`: float16 [n, heads, HEAD_DIM]."""
    heads = Q_HEADS if kind == "q" else KV_HEADS
    scale = {"q": 1.0, "k": 1.5, "v": 0.8}[kind]
    return np.stack(
        [(seeded(kind, request, p, layer).standard_normal((heads, HEAD_DIM)) * scale) for p in positions]
    ).astype(np.float16)


def causal_attention(q, k, v, starts):
    """float64 attention of q [n, Q_HEADS, D] at positions p = first + i over
    k, v [tokens, KV_HEADS, D]: row i sees the keys 0 .. starts[i]. Returns
    (out [n, Q_HEADS, D], lse [n, Q_HEADS])."""
    group = Q_HEADS // KV_HEADS
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for i, last in enumerate(starts):
        s = np.einsum("hd,thd->ht", q[i].astype(np.float64), k[: last + 1]) / math.sqrt(HEAD_DIM)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        out[i] = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v[: last + 1])
        lse[i] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
    return out, lse


def dequantized(layout, plan_rows, k, v, layer):
    """K, V [tokens, KV_HEADS, D] of one layer as the cache holds them: each
    INT4/INT2 window read back (ops.read_head) from a KVCache that stored
    the whole prompt under the plan, the FP16 rows exact."""
    cache = mixkv.KVCache(mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB))
    cache.add_sequence(0, layout, plan_of(plan_rows))
    for lay in range(LAYERS):
        cache_k = k if lay == layer else np.zeros_like(k)
        cache_v = v if lay == layer else np.zeros_like(v)
        mixkv.ops.store_prefill(cache, cache_k, cache_v, cache.prefill_mapping(0, lay))
    return read_back_windows(cache, 0, layer, k.astype(np.float64), v.astype(np.float64))


def make_engine(backend="cpu", budget=BUDGET, mode=mixkv.PrefillMode.Compact):
    cache = mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB)
    cache.fp16_windows_first = mode == mixkv.PrefillMode.Exact  # exact mode demotes whole-block windows
    return mixkv.Engine(
        cache,
        mixkv.SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, prefill_mode=mode),
        num_q_heads=Q_HEADS,
        backend=backend,
    )


def run(backend="cpu", to_device=None, from_device=None, mode=mixkv.PrefillMode.Compact):
    """Prefills both requests in chunks through the cache, then decodes one
    token each. Returns {request: outputs}: prefill out [tokens, LAYERS,
    Q_HEADS, D] and lse [tokens, LAYERS, Q_HEADS], the decode row's out
    [LAYERS, Q_HEADS, D], and each request's chunks."""
    to_device = to_device or (lambda a: a)
    from_device = from_device or (lambda a: a)
    engine = make_engine(backend, mode=mode)
    engine.add_request("chat", TEXT_TOKENS, max_new_tokens=2, arrival_time=0)
    engine.add_request("video", VIDEO, plan=plan_of(VIDEO_PLAN), max_new_tokens=2, arrival_time=1)
    lengths = {"chat": TEXT_TOKENS, "video": VIDEO.num_tokens}
    result = {
        i: dict(
            out=np.full((n, LAYERS, Q_HEADS, HEAD_DIM), np.nan, np.float16),
            lse=np.full((n, LAYERS, Q_HEADS), np.nan, np.float32),
            decode=np.full((LAYERS, Q_HEADS, HEAD_DIM), np.nan, np.float16),
            chunks=[],
        )
        for i, n in lengths.items()
    }
    while engine.has_unfinished():
        step = engine.step()
        engine.check_invariants()
        assert step.num_batched_tokens <= BUDGET
        positions = [(p.request_id, pos) for p in step.prefills for pos in range(p.start, p.end)]
        for p in step.prefills:
            result[p.request_id]["chunks"].append((p.start, p.end))
        for layer in range(LAYERS if step.prefills else 0):  # the model's layers, one prefill call each
            q, k, v = (
                np.concatenate([rows(kind, p.request_id, range(p.start, p.end), layer) for p in step.prefills])
                for kind in ("q", "k", "v")
            )
            lse = to_device(np.full((step.prefill_rows, Q_HEADS), np.nan, np.float32))
            out = from_device(engine.prefill(layer, to_device(q), to_device(k), to_device(v), lse=lse))
            assert out.shape == (step.prefill_rows, Q_HEADS, HEAD_DIM) and out.dtype == np.float16
            lse = from_device(lse)
            for r, (i, pos) in enumerate(positions):
                result[i]["out"][pos, layer] = out[r]
                result[i]["lse"][pos, layer] = lse[r]
        if step.decodes:
            assert step.decode_rows == [] and step.num_decode_rows == len(step.decodes)
            for layer in range(LAYERS):
                q, k, v = (
                    np.concatenate([rows(kind, i, [lengths[i]], layer) for i in step.decodes])
                    for kind in ("q", "k", "v")
                )
                out = from_device(engine.attend(layer, to_device(q), to_device(k), to_device(v)))
                for b, i in enumerate(step.decodes):
                    result[i]["decode"][layer] = out[b]
    assert engine.stats().prefill_tokens == sum(lengths.values())
    for p in mixkv.Precision:
        assert engine.cache.pool_stats(p).used_blocks == 0
    return result


@pytest.fixture(scope="module")
def cpu_run():
    return run()


def check_against_reference(result, request, layout, plan_rows, exact_prefill=False):
    n = layout.num_tokens
    chunks = result[request]["chunks"]
    assert chunks[0][0] == 0 and chunks[-1][1] == n and len(chunks) >= 2
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    worst = 0.0
    for layer in range(LAYERS):
        q = rows("q", request, range(n), layer)
        k = rows("k", request, range(n), layer)
        v = rows("v", request, range(n), layer)
        kq, vq = dequantized(layout, plan_rows, k, v, layer) if plan_rows else (k, v)
        for start, end in chunks:
            # Rows of earlier chunks as the cache holds them (FP16 in exact
            # mode while the prompt is prefilled), the chunk's own rows exact.
            kp, vp = (k, v) if exact_prefill else (kq, vq)
            keys = np.concatenate([kp[:start], k[start:end]])
            values = np.concatenate([vp[:start], v[start:end]])
            want, want_lse = causal_attention(q[start:end], keys, values, range(start, end))
            got = result[request]["out"][start:end, layer].astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
            np.testing.assert_allclose(result[request]["lse"][start:end, layer], want_lse, rtol=0, atol=TOLERANCE)
            worst = max(worst, float(np.abs(got - want).max()))
        # The decode after the prompt: every prompt row from the cache, then the new row.
        qn, kn, vn = (rows(kind, request, [n], layer) for kind in ("q", "k", "v"))
        want, _ = causal_attention(qn, np.concatenate([kq, kn]), np.concatenate([vq, vn]), [n])
        np.testing.assert_allclose(result[request]["decode"][layer].astype(np.float64), want[0], rtol=0, atol=TOLERANCE)
    return worst


def test_text_request_prefills_in_chunks_like_dense_causal_attention(cpu_run):
    check_against_reference(cpu_run, "chat", TokenLayout([Segment(TokenKind.Text, TEXT_TOKENS)]), None)


def test_video_request_reads_earlier_chunks_at_their_precision(cpu_run):
    check_against_reference(cpu_run, "video", VIDEO, VIDEO_PLAN)
    # A later chunk read quantized windows: exact K/V would give other outputs.
    start = next(s for s, _ in cpu_run["video"]["chunks"] if s > 8 + BLOCK)
    q, k, v = (rows(kind, "video", range(VIDEO.num_tokens), 0) for kind in ("q", "k", "v"))
    exact, _ = causal_attention(q[start:], k, v, range(start, VIDEO.num_tokens))
    assert np.abs(cpu_run["video"]["out"][start:, 0].astype(np.float64) - exact).max() > 10 * TOLERANCE


def test_exact_mode_prefills_over_fp16_and_decodes_over_the_plan():
    """PrefillMode.Exact: every chunk reads the earlier rows FP16 (the output
    of unchunked dense prefill), and the decode after the prompt reads the
    windows demoted to the plan."""
    result = run(mode=mixkv.PrefillMode.Exact)
    check_against_reference(result, "video", VIDEO, VIDEO_PLAN, exact_prefill=True)
    check_against_reference(result, "chat", TokenLayout([Segment(TokenKind.Text, TEXT_TOKENS)]), None)


def test_exact_mode_needs_fp16_windows_first():
    with pytest.raises(ValueError, match="prefill_mode"):
        mixkv.Engine(
            mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB),
            mixkv.SchedulerConfig(prefill_mode=mixkv.PrefillMode.Exact),
            num_q_heads=Q_HEADS,
        )


def torch_or_skip():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    return torch


def test_torch_cpu_tensors_give_the_numpy_bits(cpu_run):
    torch = torch_or_skip()
    result = run(to_device=lambda a: torch.from_numpy(np.ascontiguousarray(a)), from_device=lambda t: t.numpy())
    for request in ("chat", "video"):
        assert result[request]["chunks"] == cpu_run[request]["chunks"]
        for field in ("out", "lse", "decode"):
            np.testing.assert_array_equal(result[request][field], cpu_run[request][field])


def test_prefill_allocates_out_like_q():
    torch = torch_or_skip()
    engine = make_engine()
    engine.add_request("a", 20, max_new_tokens=1)
    engine.step()
    q = torch.from_numpy(rows("q", "a", range(20), 0))
    kv = torch.from_numpy(rows("k", "a", range(20), 0))
    out = engine.prefill(0, q, kv, kv)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and tuple(out.shape) == (20, Q_HEADS, HEAD_DIM)
    given = torch.empty(20, Q_HEADS, HEAD_DIM, dtype=torch.float16)
    assert engine.prefill(1, q, kv, kv, out=given) is given


def test_bad_arrays_name_the_argument_and_change_nothing():
    engine = make_engine()
    q = np.zeros((20, Q_HEADS, HEAD_DIM), np.float16)
    kv = np.zeros((20, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: no step yet: expected step\(\) first"):
        engine.prefill(0, q, kv, kv, out=np.zeros_like(q))
    engine.add_request("a", 20, max_new_tokens=2)
    step = engine.step()
    assert step.prefill_rows == 20
    before = engine.describe_state()
    F16 = r"expected a C-contiguous float16 array on cpu"
    with pytest.raises(mixkv.InvalidArgument, match=rf"Engine.prefill: q: {F16}, got float32"):
        engine.prefill(0, q.astype(np.float32), kv, kv)
    with pytest.raises(mixkv.InvalidArgument, match=rf"Engine.prefill: k: {F16}, got float32"):
        engine.prefill(0, q, kv.astype(np.float32), kv)
    with pytest.raises(mixkv.InvalidArgument, match=rf"Engine.prefill: v: {F16}, got a non-contiguous array"):
        engine.prefill(0, q, kv, np.zeros((20, HEAD_DIM, KV_HEADS), np.float16).transpose(0, 2, 1))
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.prefill: k: .* got list"):
        engine.prefill(0, q, [[1.0]], kv)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: q: expected .*shape \(20, 4, 64\)"):
        engine.prefill(0, q[:-1], kv, kv)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: q: expected .*shape \(20, 4, 64\)"):
        engine.prefill(0, np.zeros((20, KV_HEADS, HEAD_DIM), np.float16), kv, kv)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: k: expected .*shape \(20, 2, 64\)"):
        engine.prefill(0, q, kv[:-1], kv)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: v: expected .*shape \(20, 2, 64\)"):
        engine.prefill(0, q, kv, np.zeros((20, KV_HEADS, 16), np.float16))
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: out: expected .*shape \(20, 4, 64\)"):
        engine.prefill(0, q, kv, kv, out=np.zeros((19, Q_HEADS, HEAD_DIM), np.float16))
    readonly = np.zeros_like(q)
    readonly.flags.writeable = False
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.prefill: out: .*got a read-only array"):
        engine.prefill(0, q, kv, kv, out=readonly)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.prefill: lse: expected a C-contiguous float32 array"):
        engine.prefill(0, q, kv, kv, lse=np.zeros((20, Q_HEADS), np.float16))
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: lse: expected .*shape \(20, 4\)"):
        engine.prefill(0, q, kv, kv, lse=np.zeros((20, Q_HEADS, 1), np.float32))
    with pytest.raises(IndexError, match="layer"):
        engine.prefill(LAYERS, q, kv, kv)
    assert engine.describe_state() == before
    engine.check_invariants()
    for layer in range(LAYERS):
        assert engine.prefill(layer, q, kv, kv).shape == (20, Q_HEADS, HEAD_DIM)
    # A step without prefill rows takes empty arrays.
    step = engine.step()
    assert step.prefills == [] and step.decodes == ["a"]
    empty = engine.prefill(0, q[:0], kv[:0], kv[:0])
    assert empty.shape == (0, Q_HEADS, HEAD_DIM)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine::prefill: q: expected .*shape \(0, 4, 64\)"):
        engine.prefill(0, q, kv, kv)


# --------------------------------------------------------------------------------------------------------------------
# The CUDA backend: the same chunks, the CPU backend's outputs within 2e-3.
def cuda_unavailable():
    if not mixkv.built_with_cuda:
        return "mixkv was built without CUDA (MIXKV_CUDA=OFF)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


def test_cuda_prefill_matches_the_cpu_backend(cpu_run):
    why = cuda_unavailable()
    if why:
        pytest.skip(why)
    import torch

    result = run(
        backend="cuda",
        to_device=lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda(),
        from_device=lambda t: t.cpu().numpy(),
    )
    for request in ("chat", "video"):
        assert result[request]["chunks"] == cpu_run[request]["chunks"]
        for field in ("out", "lse", "decode"):
            got = result[request][field].astype(np.float64)
            want = cpu_run[request][field].astype(np.float64)
            assert np.isfinite(got).all(), (request, field)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=f"{request} {field}")
