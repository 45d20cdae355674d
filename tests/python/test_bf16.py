"""A BF16 cache (CacheShape(dtype=DType.BF16)) from Python: the dtype as
CacheShape and BlockFormat carry it; mixkv.ops on a KVCache with
torch.bfloat16 K/V and queries (NumPy has no bfloat16: its arrays are
refused, naming the argument); mixkv.Engine prefilling in chunks and
decoding with torch.bfloat16 arrays, each output held to a float64
attention over the same bfloat16 values (quantized windows as ops.read_head
reads them), outputs allocated as bfloat16; the same on the CUDA backend
(torch.bfloat16 CUDA tensors), held to the float64 attention and to the CPU
engine's outputs within the bfloat16 roundings of its kernels. mixkv.cuda's
low-level DeviceKVCache (arrays through __cuda_array_interface__, which has
no bfloat16) refuses a BF16 cache, naming the field."""

import math
import zlib

import mixkv
import numpy as np
import pytest
from helpers import P, plan_of, read_back_windows
from mixkv import DType, Segment, TokenKind, TokenLayout

torch = pytest.importorskip("torch")

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16  # a built CUDA BF16 instance
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, dtype=DType.BF16)
SLAB = 32 << 10
BUDGET = 40
VIDEO = TokenLayout([Segment(TokenKind.Text, 8), Segment(TokenKind.Visual, 4 * BLOCK), Segment(TokenKind.Text, 6)])
VIDEO_PLAN = [[P.FP16, P.INT4, P.INT2, P.INT4], [P.FP16, P.INT2, P.INT4, P.FP16]]
TEXT_TOKENS = 45


def bf16_bits_to_float(bits):
    """float64 values of bfloat16 bit patterns (uint16)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def as_float64(t):
    return t.to(torch.float64).numpy()


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rows(kind, request, positions, layer):
    """torch.bfloat16 [n, heads, HEAD_DIM] rows of `request` at `positions`."""
    heads = Q_HEADS if kind == "q" else KV_HEADS
    scale = {"q": 1.0, "k": 1.5, "v": 0.8}[kind]
    a = np.stack([seeded(kind, request, p, layer).standard_normal((heads, HEAD_DIM)) * scale for p in positions])
    return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)


def causal_attention(q, k, v, starts):
    """float64 attention of q [n, Q_HEADS, D] over k, v [tokens, KV_HEADS, D]:
    row i sees keys 0 .. starts[i]."""
    group = Q_HEADS // KV_HEADS
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    out = np.zeros(q.shape)
    for i, last in enumerate(starts):
        s = np.einsum("hd,thd->ht", q[i], k[: last + 1]) / math.sqrt(HEAD_DIM)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v[: last + 1])
    return out


def assert_bf16_close(got, want):
    """Within bfloat16 rounding of the output (2^-8 relative) plus the
    float32 arithmetic's share."""
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2e-3)


def assert_bf16_kernel_close(got, want):
    """The CUDA kernels round more than the output to bfloat16: P before the
    PV MMA, and on quantized blocks q * s_K and P * s_V (decode) or the
    dequantized tile (extend), each within 2^-9 relative; on this data a
    float64 model of those roundings stays below 4e-3 absolute."""
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=8e-3)


# -- the dtype -----------------------------------------------------------------------------------------------------
def test_cache_shape_carries_the_dtype():
    assert mixkv.CacheShape(1, 1, 64).dtype == DType.F16
    assert repr(mixkv.CacheShape(1, 1, 64)) == "CacheShape(num_layers=1, num_kv_heads=1, head_dim=64, block_size=32)"
    for given in (DType.BF16, "bfloat16", "bf16", torch.bfloat16):
        shape = mixkv.CacheShape(1, 1, 64, dtype=given)
        assert shape.dtype == DType.BF16
    assert "dtype=bfloat16" in repr(SHAPE)
    assert mixkv.dtype_name(DType.BF16) == "bfloat16"
    assert mixkv.CacheShape(1, 1, 64) != mixkv.CacheShape(1, 1, 64, dtype=DType.BF16)
    shape = mixkv.CacheShape(1, 1, 64)
    shape.dtype = torch.float16
    assert shape.dtype == DType.F16
    with pytest.raises(mixkv.InvalidArgument, match="shape.dtype = 'int8'"):
        mixkv.CacheShape(1, 1, 64, dtype="int8")
    with pytest.raises(mixkv.InvalidArgument, match="shape.dtype = float32, expected float16 or bfloat16"):
        mixkv.CacheShape(1, 1, 64, dtype=DType.F32).validate()
    fmt = mixkv.BlockFormat(P.INT4, 2, 64, 16, dtype=DType.BF16)
    assert fmt.dtype == DType.BF16
    assert fmt.block_bytes == mixkv.BlockFormat(P.INT4, 2, 64, 16).block_bytes


# -- mixkv.ops on a BF16 KVCache -------------------------------------------------------------------------------------
def bf16_cache():
    return mixkv.KVCache(mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB))


def test_ops_store_and_read_bfloat16_past_the_fp16_range():
    cache = bf16_cache()
    layout = TokenLayout([Segment(TokenKind.Visual, 2 * BLOCK), Segment(TokenKind.Text, 5)])
    cache.add_sequence(0, layout, plan_of([[P.INT4, P.FP16]] * LAYERS))
    assert cache.format(P.INT4).dtype == DType.BF16
    k = rows("k", 0, range(layout.num_tokens), 0) * 1e5  # far past FP16's 65504
    v = rows("v", 0, range(layout.num_tokens), 0)
    for layer in range(LAYERS):
        mixkv.ops.store_prefill(cache, k, v, cache.prefill_mapping(0, layer))
    mapping = cache.prefill_mapping(0, 0)
    (window,) = mapping.int4_windows
    fmt = cache.format(P.INT4)
    block = cache.block(P.INT4, window.block_id)
    for h in range(KV_HEADS):
        wk, wv = mixkv.ops.read_head(fmt, block[h * fmt.head_bytes : (h + 1) * fmt.head_bytes])
        want_k = as_float64(k[window.first_row : window.first_row + BLOCK, h])
        assert np.all(np.isfinite(wk))
        # Within half an INT4 step (range / 15 / 2) plus the bfloat16 rounding of the parameters.
        step = (want_k.max(0) - want_k.min(0)) / 15
        assert np.all(np.abs(wk - want_k) <= 0.5 * step * (1 + 2**-7) + np.abs(want_k) * 2**-8)
    # An FP16-pool row holds the bfloat16 bits themselves.
    slot = mapping.fp16_slots[2 * BLOCK]
    fp16 = cache.format(P.FP16)
    fblock = cache.block(P.FP16, slot // BLOCK)
    head = fblock[: fp16.head_bytes]
    row = head[fp16.k_offset + (slot % BLOCK) * HEAD_DIM * 2 : fp16.k_offset + (slot % BLOCK + 1) * HEAD_DIM * 2]
    np.testing.assert_array_equal(bf16_bits_to_float(row.view(np.uint16)), as_float64(k[2 * BLOCK, 0]))


def test_ops_refuse_numpy_and_float16_for_a_bf16_cache():
    text = TokenLayout([Segment(TokenKind.Text, 20)])
    cache = bf16_cache()
    cache.add_sequence(0, text, mixkv.PrecisionPlan(LAYERS, 0))
    mapping = cache.prefill_mapping(0, 0)
    k = np.zeros((20, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(mixkv.InvalidArgument, match="store_prefill: k: expected a bfloat16 array on cpu.*NumPy"):
        mixkv.ops.store_prefill(cache, k, k, mapping)
    with pytest.raises(mixkv.InvalidArgument, match="store_prefill: v: expected a C-contiguous bfloat16 array"):
        mixkv.ops.store_prefill(
            cache,
            torch.zeros(20, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),
            torch.zeros(20, KV_HEADS, HEAD_DIM, dtype=torch.float16),
            mapping,
        )
    with pytest.raises(mixkv.InvalidArgument, match=r"store_prefill: k: expected shape \(rows=20"):
        mixkv.ops.store_prefill(
            cache,
            torch.zeros(19, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),
            torch.zeros(20, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),
            mapping,
        )
    # The FP16 cache keeps taking NumPy float16 only.
    fp16 = mixkv.KVCache(mixkv.CacheConfig(mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK), 32 * SLAB, SLAB))
    fp16.add_sequence(0, text, mixkv.PrecisionPlan(LAYERS, 0))
    with pytest.raises(mixkv.InvalidArgument, match="store_prefill: k: expected a NumPy float16 array"):
        mixkv.ops.store_prefill(
            fp16, torch.zeros(20, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16), k, fp16.prefill_mapping(0, 0)
        )


def test_ops_decode_matches_float64_on_the_cached_values():
    cache = bf16_cache()
    cache.add_sequence(0, VIDEO, plan_of(VIDEO_PLAN))
    n = VIDEO.num_tokens
    kv = {}
    for layer in range(LAYERS):
        k, v = rows("k", 0, range(n), layer), rows("v", 0, range(n), layer)
        mixkv.ops.store_prefill(cache, k, v, cache.prefill_mapping(0, layer))
        kv[layer] = (k, v)
    md = cache.decode_metadata([0])
    for layer in range(LAYERS):
        q = rows("q", 0, [n], layer)
        out, lse = mixkv.ops.paged_decode_attention(cache, md, layer, q)
        assert out.dtype == np.float32 and out.shape == (1, Q_HEADS, HEAD_DIM)
        k, v = read_back_windows(cache, 0, layer, *(as_float64(a) for a in kv[layer]))
        want = causal_attention(as_float64(q), k, v, [n - 1])
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    with pytest.raises(mixkv.InvalidArgument, match="paged_decode_attention: q"):
        mixkv.ops.paged_decode_attention(cache, md, 0, np.zeros((1, Q_HEADS, HEAD_DIM), np.float16))


# -- mixkv.Engine ----------------------------------------------------------------------------------------------------
def make_engine(backend="cpu"):
    return mixkv.Engine(
        mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB),
        mixkv.SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET),
        num_q_heads=Q_HEADS,
        backend=backend,
    )


def run(backend="cpu"):
    """Prefills a text and a video request in chunks, then decodes one token
    each; returns {request: (prefill out [tokens, LAYERS, Q_HEADS, D] float64,
    decode out [LAYERS, Q_HEADS, D], chunks)}."""
    device = "cuda" if backend == "cuda" else "cpu"
    engine = make_engine(backend)
    engine.add_request("chat", TEXT_TOKENS, max_new_tokens=2, arrival_time=0)
    engine.add_request("video", VIDEO, plan=plan_of(VIDEO_PLAN), max_new_tokens=2, arrival_time=1)
    lengths = {"chat": TEXT_TOKENS, "video": VIDEO.num_tokens}
    result = {
        i: (np.full((n, LAYERS, Q_HEADS, HEAD_DIM), np.nan), np.full((LAYERS, Q_HEADS, HEAD_DIM), np.nan), [])
        for i, n in lengths.items()
    }
    while engine.has_unfinished():
        step = engine.step()
        positions = [(p.request_id, pos) for p in step.prefills for pos in range(p.start, p.end)]
        for p in step.prefills:
            result[p.request_id][2].append((p.start, p.end))
        for layer in range(LAYERS if step.prefills else 0):
            q, k, v = (
                torch.cat([rows(kind, p.request_id, range(p.start, p.end), layer) for p in step.prefills]).to(device)
                for kind in ("q", "k", "v")
            )
            out = engine.prefill(layer, q, k, v)
            assert out.dtype == torch.bfloat16 and out.device.type == device
            out = as_float64(out.cpu())
            for r, (i, pos) in enumerate(positions):
                result[i][0][pos, layer] = out[r]
        for layer in range(LAYERS if step.decodes else 0):
            q, k, v = (
                torch.cat([rows(kind, i, [lengths[i]], layer) for i in step.decodes]).to(device)
                for kind in ("q", "k", "v")
            )
            out = engine.attend(layer, q, k, v)
            assert out.dtype == torch.bfloat16
            out = as_float64(out.cpu())
            for b, i in enumerate(step.decodes):
                result[i][1][layer] = out[b]
    return result


@pytest.fixture(scope="module")
def cpu_run():
    return run()


def cached(layout, plan_rows, k, v, layer):
    """K, V of one layer as a BF16 cache holds them (quantized windows read back)."""
    cache = bf16_cache()
    cache.add_sequence(0, layout, plan_of(plan_rows))
    for lay in range(LAYERS):
        z = torch.zeros_like(k)
        mixkv.ops.store_prefill(
            cache, k if lay == layer else z, v if lay == layer else z, cache.prefill_mapping(0, lay)
        )
    return read_back_windows(cache, 0, layer, as_float64(k), as_float64(v))


def check_against_float64(result, request_id, close):
    """Every prefill chunk and the decode of `request_id` in `result` (run())
    against the float64 attention over what the cache holds."""
    layout = VIDEO if request_id == "video" else TokenLayout([Segment(TokenKind.Text, TEXT_TOKENS)])
    plan_rows = VIDEO_PLAN if request_id == "video" else None
    prefill, decode, chunks = result[request_id]
    n = layout.num_tokens
    assert len(chunks) >= 2 and chunks[-1][1] == n
    for layer in range(LAYERS):
        q, k, v = (rows(kind, request_id, range(n), layer) for kind in ("q", "k", "v"))
        kq, vq = cached(layout, plan_rows, k, v, layer) if plan_rows else (as_float64(k), as_float64(v))
        kx, vx = as_float64(k), as_float64(v)
        for start, end in chunks:
            keys = np.concatenate([kq[:start], kx[start:end]])
            values = np.concatenate([vq[:start], vx[start:end]])
            want = causal_attention(as_float64(q[start:end]), keys, values, range(start, end))
            close(prefill[start:end, layer], want)
        qn, kn, vn = (as_float64(rows(kind, request_id, [n], layer)) for kind in ("q", "k", "v"))
        want = causal_attention(qn, np.concatenate([kq, kn]), np.concatenate([vq, vn]), [n])
        close(decode[layer], want[0])


@pytest.mark.parametrize("request_id", ["chat", "video"])
def test_engine_prefills_and_decodes_bfloat16(cpu_run, request_id):
    check_against_float64(cpu_run, request_id, assert_bf16_close)


def test_engine_refuses_other_dtypes_naming_the_argument():
    engine = make_engine()
    engine.add_request("a", 10, max_new_tokens=1)
    step = engine.step()
    assert step.prefill_rows == 10
    bf = lambda heads: torch.zeros(10, heads, HEAD_DIM, dtype=torch.bfloat16)  # noqa: E731
    with pytest.raises(mixkv.InvalidArgument, match="Engine.store: k: expected a C-contiguous bfloat16 array"):
        engine.store(0, torch.zeros(10, KV_HEADS, HEAD_DIM, dtype=torch.float16), bf(KV_HEADS))
    with pytest.raises(mixkv.InvalidArgument, match="Engine.store: v: .*bfloat16.*got float16"):
        engine.store(0, bf(KV_HEADS), np.zeros((10, KV_HEADS, HEAD_DIM), np.float16))
    with pytest.raises(mixkv.InvalidArgument, match="Engine.prefill: q: .*bfloat16"):
        engine.prefill(0, torch.zeros(10, Q_HEADS, HEAD_DIM, dtype=torch.float16), bf(KV_HEADS), bf(KV_HEADS))
    with pytest.raises(mixkv.InvalidArgument, match="Engine.prefill: out: .*bfloat16"):
        engine.prefill(0, bf(Q_HEADS), bf(KV_HEADS), bf(KV_HEADS), out=torch.zeros(10, Q_HEADS, HEAD_DIM))
    with pytest.raises(mixkv.InvalidArgument, match="NumPy and CuPy have no bfloat16"):
        engine.prefill(0, np.zeros((10, Q_HEADS, HEAD_DIM), np.float16), bf(KV_HEADS), bf(KV_HEADS))
    out = torch.full((10, Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    assert engine.prefill(0, bf(Q_HEADS), bf(KV_HEADS), bf(KV_HEADS), out=out) is out
    assert not torch.isnan(out).any()


cuda_available = mixkv.built_with_cuda and torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not cuda_available, reason="needs mixkv built with CUDA and a visible GPU")


@pytest.fixture(scope="module")
def cuda_run():
    return run("cuda")


@needs_cuda
@pytest.mark.parametrize("request_id", ["chat", "video"])
def test_cuda_engine_prefills_and_decodes_bfloat16(cuda_run, cpu_run, request_id):
    check_against_float64(cuda_run, request_id, assert_bf16_kernel_close)
    prefill, decode, chunks = cuda_run[request_id]
    cpu_prefill, cpu_decode, cpu_chunks = cpu_run[request_id]
    assert chunks == cpu_chunks  # the same schedule on both backends
    assert_bf16_kernel_close(prefill, cpu_prefill)
    assert_bf16_kernel_close(decode, cpu_decode)


@needs_cuda
def test_cuda_engine_refuses_float16_for_a_bf16_cache():
    engine = make_engine("cuda")
    engine.add_request("a", 10, max_new_tokens=1)
    assert engine.step().prefill_rows == 10
    bf = lambda heads: torch.zeros(10, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    half_q = torch.zeros(10, Q_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda")
    with pytest.raises(mixkv.InvalidArgument, match="Engine.prefill: q: .*bfloat16"):
        engine.prefill(0, half_q, bf(KV_HEADS), bf(KV_HEADS))
    with pytest.raises(mixkv.InvalidArgument, match="Engine.store: k: .*bfloat16"):
        engine.store(0, torch.zeros(10, KV_HEADS, HEAD_DIM, dtype=torch.float16, device="cuda"), bf(KV_HEADS))
    out = engine.prefill(0, bf(Q_HEADS), bf(KV_HEADS), bf(KV_HEADS))
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda" and not torch.isnan(out).any()


@needs_cuda
def test_device_kv_cache_refuses_a_bf16_cache():
    # mixkv.cuda's ops take arrays through __cuda_array_interface__, which has no bfloat16.
    import mixkv.cuda

    with pytest.raises(mixkv.InvalidArgument, match="DeviceKVCache: config.shape.dtype = bfloat16: expected float16"):
        mixkv.cuda.DeviceKVCache(mixkv.CacheConfig(SHAPE, 32 * SLAB, SLAB))
