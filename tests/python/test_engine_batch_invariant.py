"""mixkv.Engine(batch_invariant=...): the option is checked and reaches the
engine's config; a request's decode outputs are bitwise the same alone,
after or before other requests and among others arriving while it decodes,
on the CPU backend (batch-invariant either way) and, where it can run, on
the CUDA backend with the option on. Every K/V/Q row is a seeded function of
(request, position, layer), so only the batch around the request differs."""

import importlib.util
import zlib

import mixkv
import mixkv.engine
import numpy as np
import pytest
from helpers import layout, plan_of
from mixkv import Precision

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 32
SHAPE = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
SLAB = 1 << 20
TARGET = "target"


def engine_of(backend="cpu", **kw):
    config = mixkv.CacheConfig(SHAPE, 48 * SLAB, SLAB)
    sched = mixkv.SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16384, demote_under_pressure=False)
    return mixkv.Engine(config, sched, num_q_heads=Q_HEADS, backend=backend, **kw)


def rows(kind, key, position, layer, heads):
    rng = np.random.default_rng(zlib.crc32(repr((kind, key, position, layer)).encode()))
    return rng.standard_normal((heads, HEAD_DIM)).astype(np.float16)


def request(key, windows, new, shift):
    """Text, `windows` visual windows of FP16, INT4 and INT2 by turns, a partial window, text."""
    lay = layout(("text", 9 + shift % 7), ("visual", windows * BLOCK + 5 + shift % 11), ("text", 6 + shift % 5))
    n = lay.num_windows(BLOCK)
    kinds = [Precision.FP16, Precision.INT4, Precision.INT2]
    plan = plan_of(
        [[Precision.FP16 if w == 0 else kinds[(w + layer + shift) % 3] for w in range(n)] for layer in range(2)]
    )
    return dict(key=key, layout=lay, plan=plan, new=new)


def runs():
    """(name, [(arrival step, request)]) for the target alone and among eleven others."""
    target = request(TARGET, 24, 24, 0)
    others = [request(f"other-{i}", 1 + (i * 5) % 27, 3 + (i * 7) % 38, i + 1) for i in range(11)]
    staggered = [(0 if i % 2 == 0 else 2 + (i % 3) * 3, r) for i, r in enumerate(others)]
    staggered.insert(4, (0, target))
    staggered.sort(key=lambda a: a[0])
    return [
        ("alone", [(0, target)]),
        ("last of 12", [(0, r) for r in others] + [(0, target)]),
        ("first, others reversed", [(0, target)] + [(0, r) for r in reversed(others)]),
        ("among others arriving while it decodes", staggered),
    ]


def target_rows(engine, arrivals, to_device=np.asarray, from_device=np.asarray):
    """Runs `arrivals` to the end; {(position, layer): (out bytes, lse bytes)} of the target's decodes."""
    got = {}
    last = max(at for at, _ in arrivals)
    for step_no in range(1000):
        for at, r in arrivals:
            if at == step_no:
                engine.add_request(r["key"], r["layout"], plan=r["plan"], max_new_tokens=r["new"])
        if not engine.has_unfinished():
            if step_no >= last:
                break
            continue
        step = engine.step()
        decodes = list(step.decodes)
        positions = [engine.cache.num_tokens(key) - 1 for key in decodes]
        for layer in range(LAYERS):
            ks, vs = [], []
            for p in step.prefills:
                ks += [rows("k", p.request_id, pos, layer, KV_HEADS) for pos in range(p.start, p.end)]
                vs += [rows("v", p.request_id, pos, layer, KV_HEADS) for pos in range(p.start, p.end)]
            if ks:
                engine.store(layer, to_device(np.stack(ks)), to_device(np.stack(vs)))
            if not decodes:
                continue
            q = np.stack([rows("q", key, pos, layer, Q_HEADS) for key, pos in zip(decodes, positions)])
            k = np.stack([rows("k", key, pos, layer, KV_HEADS) for key, pos in zip(decodes, positions)])
            v = np.stack([rows("v", key, pos, layer, KV_HEADS) for key, pos in zip(decodes, positions)])
            lse = to_device(np.zeros((len(decodes), Q_HEADS), np.float32))
            out = from_device(engine.attend(layer, to_device(q), to_device(k), to_device(v), lse=lse))
            lse = from_device(lse)
            if TARGET in decodes:
                b = decodes.index(TARGET)
                got[(positions[b], layer)] = (out[b].tobytes(), lse[b].tobytes())
    assert not engine.has_unfinished()
    return got


def check_invariant(results):
    (_, alone), *others = results
    assert len(alone) >= 40  # 23 decodes x 2 layers
    for name, got in others:
        assert got.keys() == alone.keys(), name
        differing = [k for k in alone if got[k] != alone[k]]
        assert not differing, f"{name}: {len(differing)} rows differ from the target alone, first {differing[0]}"


def test_batch_invariant_option_is_checked_and_reaches_the_config():
    default = mixkv.engine.BATCH_INVARIANT_BLOCKS
    assert isinstance(default, int) and default > 0
    assert engine_of().batch_invariant_blocks == 0
    assert engine_of(batch_invariant=False).config.batch_invariant_blocks == 0
    assert engine_of(batch_invariant=0).batch_invariant_blocks == 0
    assert engine_of(batch_invariant=True).batch_invariant_blocks == default
    assert engine_of(batch_invariant=8).config.batch_invariant_blocks == 8
    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(mixkv.InvalidArgument, match=rf"Engine: batch_invariant = {bad}: expected True, False"):
            engine_of(batch_invariant=bad)
    for bad in ("yes", 1.5, None):
        with pytest.raises(mixkv.InvalidArgument, match=r"Engine: batch_invariant: expected a bool or an int"):
            engine_of(batch_invariant=bad)
    # The C++ config refuses what the keyword would have, naming the field.
    config = engine_of().config
    config.batch_invariant_blocks = -3
    with pytest.raises(mixkv.InvalidArgument, match=r"batch_invariant_blocks = -3"):
        mixkv.engine._engine.Engine(config)


@pytest.mark.parametrize("invariant", [False, True])
def test_cpu_decode_is_batch_invariant(invariant):
    check_invariant([(name, target_rows(engine_of(batch_invariant=invariant), a)) for name, a in runs()])


def cuda_unavailable():
    if not mixkv.built_with_cuda:
        return "mixkv was built without CUDA (MIXKV_CUDA=OFF)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


@pytest.mark.parametrize("blocks", [4, True])
def test_cuda_decode_is_batch_invariant(blocks):
    why = cuda_unavailable()
    if why:
        pytest.skip(why)
    import torch

    def to_device(a):
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def from_device(t):
        torch.cuda.synchronize()
        return t.cpu().numpy()

    results = [
        (name, target_rows(engine_of("cuda", batch_invariant=blocks), a, to_device, from_device)) for name, a in runs()
    ]
    check_invariant(results)
    # The same outputs as the CPU backend, within the quantized kernels' tolerance.
    cpu = target_rows(engine_of(), runs()[0][1])
    for key, (out, lse) in results[0][1].items():
        want = np.frombuffer(cpu[key][0], np.float16).astype(np.float32)
        got = np.frombuffer(out, np.float16).astype(np.float32)
        np.testing.assert_allclose(got, want, atol=5e-3, rtol=0, err_msg=str(key))
        want_lse = np.frombuffer(cpu[key][1], np.float32)
        np.testing.assert_allclose(np.frombuffer(lse, np.float32), want_lse, atol=1e-3, rtol=0, err_msg=str(key))
