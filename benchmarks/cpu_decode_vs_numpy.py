"""mixkv's CPU decode attention against dense NumPy on the same data, side by
side in one run.

    pip install .    # or PYTHONPATH at a directory holding the built mixkv package
    python3 benchmarks/cpu_decode_vs_numpy.py [--reps 15] [--quick]

For each shape (Llama-3-8B: 32 query / 8 KV heads x 128, batch 8 x 2,048
tokens; SmolLM2-135M: 9 / 3 x 64 at a few sizes; block 32, one layer) it
stores the same random FP16 K/V into four mixkv caches (all-FP16, all-INT4,
all-INT2, and per 10 windows 1 FP16 / 3 INT4 / 6 INT2) and times, in turn
within every repetition so that load changes hit all alike:
  - mixkv.ops.paged_decode_attention on each cache, 1 and 2 threads
    (MIXKV_NUM_THREADS, read at every call);
  - dense NumPy, per sequence: q @ K^T, max-subtracted softmax, @ V, float32,
    K/V held as float32 [kv_head, token, dim] arrays made before timing
    ("numpy f32"), and the same with float16 K/V converted inside the call
    ("numpy f16"), with NumPy's BLAS at 1 and 2 threads (threadpoolctl if
    present, else OpenBLAS's own setter).
Every repetition runs each case once, in a fresh random order. Reports
medians (ms per layer), each case against numpy f32 (1 thread, and the
faster of 1 and 2 threads), and three checks: mixkv FP16 against NumPy (relative error),
1 vs 2 threads bit-identical, AVX2 vs portable kernel bit-identical
(MIXKV_CPU_SIMD=portable). Writes benchmarks/results/cpu_decode_vs_numpy.
{json,png,md}.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, where the machine sets them for old
OpenBLAS builds, slow a current NumPy: they are dropped for this process
before NumPy loads (the JSON records the kernel OpenBLAS then runs).
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import time

DROPPED_ENV = {name: os.environ.pop(name) for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if name in os.environ}

import mixkv  # noqa: E402
import numpy as np  # noqa: E402
from mixkv import ops  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BLOCK = 32
PLANS = ["fp16", "int4", "int2", "mixed"]
P = mixkv.Precision


class BlasThreads:
    """Sets NumPy's BLAS thread count: threadpoolctl, else OpenBLAS's setter."""

    def __init__(self):
        self.info = {}
        try:
            from threadpoolctl import ThreadpoolController

            self.controller = ThreadpoolController()
            self.info = {k: v for k, v in self.controller.info()[0].items() if k != "filepath"}
            self.setter = None
        except ImportError:
            self.controller = None
            path = next(line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line)
            lib = ctypes.CDLL(path)
            self.setter = next(
                getattr(lib, name)
                for name in (
                    "scipy_openblas_set_num_threads64_",
                    "openblas_set_num_threads64_",
                    "openblas_set_num_threads",
                )
                if hasattr(lib, name)
            )
            self.info = {"internal_api": "openblas", "setter": self.setter.__name__}

    def set(self, n):
        if self.controller is not None:
            self.controller.limit(limits=n, user_api="blas")
        else:
            self.setter(ctypes.c_int(n))


def window_precision(plan, w):
    if plan == "mixed":
        r = w % 10
        return P.FP16 if r == 0 else (P.INT4 if r <= 3 else P.INT2)
    return {"fp16": P.FP16, "int4": P.INT4, "int2": P.INT2}[plan]


def build_cache(plan, k, v, q_heads):
    """One layer, `batch` sequences of the given K/V ([batch][tokens, kv, dim])."""
    batch, tokens, kv_heads, dim = k.shape
    shape = mixkv.CacheShape(1, kv_heads, dim, BLOCK)
    fp16_bytes = batch * tokens * kv_heads * dim * 4
    slab = 1 << 20
    cache = mixkv.KVCache(mixkv.CacheConfig(shape, (fp16_bytes // slab + 8 + batch) * slab, slab))
    lay = mixkv.TokenLayout([mixkv.Segment(mixkv.TokenKind.Visual, tokens)])
    windows = lay.num_windows(BLOCK)
    for s in range(batch):
        pp = mixkv.PrecisionPlan(1, windows)
        for w in range(windows):
            pp.set(0, w, window_precision(plan, w))
        cache.add_sequence(s, lay, pp)
        ops.store_prefill(cache, k[s], v[s], cache.prefill_mapping(s, 0))
    return cache, cache.decode_metadata(list(range(batch)))


def numpy_decode(q, ks, vs, sm_scale, out):
    """What a NumPy user writes: per sequence, scores, softmax, weighted sum."""
    batch, q_heads, dim = q.shape
    kv_heads = ks[0].shape[0]
    q32 = q.astype(np.float32).reshape(batch, kv_heads, q_heads // kv_heads, dim)
    for b in range(batch):
        k = ks[b] if ks[b].dtype == np.float32 else ks[b].astype(np.float32)
        v = vs[b] if vs[b].dtype == np.float32 else vs[b].astype(np.float32)
        s = (q32[b] @ k.transpose(0, 2, 1)) * sm_scale  # [kv, group, tokens]
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[b] = (p @ v).reshape(q_heads, dim)
    return out


def run_shape(name, q_heads, kv_heads, dim, batch, tokens, reps, blas, rng):
    sm_scale = 1.0 / np.sqrt(dim)
    k = rng.standard_normal((batch, tokens, kv_heads, dim)).astype(np.float16)
    v = rng.standard_normal((batch, tokens, kv_heads, dim)).astype(np.float16)
    q = rng.standard_normal((batch, q_heads, dim)).astype(np.float16)
    caches = {plan: build_cache(plan, k, v, q_heads) for plan in PLANS}
    k16 = [np.ascontiguousarray(k[b].transpose(1, 0, 2)) for b in range(batch)]
    v16 = [np.ascontiguousarray(v[b].transpose(1, 0, 2)) for b in range(batch)]
    k32 = [x.astype(np.float32) for x in k16]
    v32 = [x.astype(np.float32) for x in v16]
    np_out = np.empty((batch, q_heads, dim), np.float32)

    def mixkv_case(plan, threads):
        cache, md = caches[plan]

        def call():
            os.environ["MIXKV_NUM_THREADS"] = str(threads)
            ops.paged_decode_attention(cache, md, 0, q, sm_scale=sm_scale)

        return call

    def numpy_case(ks, vs, threads):
        def call():
            blas.set(threads)
            numpy_decode(q, ks, vs, sm_scale, np_out)
            blas.set(1)  # no BLAS threads left waiting for work while the next case runs

        return call

    cases = {}
    for threads in (1, 2):
        for plan in PLANS:
            cases[(plan, threads)] = mixkv_case(plan, threads)
        cases[("numpy f32", threads)] = numpy_case(k32, v32, threads)
        cases[("numpy f16", threads)] = numpy_case(k16, v16, threads)

    # Calls per sample: enough for ~20 ms, from one warm-up call each.
    inner = {}
    for key, call in cases.items():
        call()
        t = time.perf_counter()
        call()
        inner[key] = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    samples = {key: [] for key in cases}
    keys = list(cases)
    order_rng = np.random.default_rng(7)
    for _ in range(reps):
        for index in order_rng.permutation(len(keys)):  # a fresh order each round: no case always follows another
            key = keys[index]
            call = cases[key]
            n = inner[key]
            t = time.perf_counter()
            for _ in range(n):
                call()
            samples[key].append((time.perf_counter() - t) / n * 1e3)

    # Checks on the same data.
    blas.set(2)
    want = numpy_decode(q, k32, v32, sm_scale, np.empty_like(np_out)).astype(np.float64)
    cache, md = caches["fp16"]
    os.environ["MIXKV_NUM_THREADS"] = "2"
    got2, lse2 = ops.paged_decode_attention(cache, md, 0, q, sm_scale=sm_scale)
    os.environ["MIXKV_NUM_THREADS"] = "1"
    got1, lse1 = ops.paged_decode_attention(cache, md, 0, q, sm_scale=sm_scale)
    identical_threads = bool(np.array_equal(got1, got2) and np.array_equal(lse1, lse2))
    identical_simd = True
    for plan in PLANS:
        c, m = caches[plan]
        os.environ.pop("MIXKV_CPU_SIMD", None)
        a = ops.paged_decode_attention(c, m, 0, q, sm_scale=sm_scale)
        os.environ["MIXKV_CPU_SIMD"] = "portable"
        b = ops.paged_decode_attention(c, m, 0, q, sm_scale=sm_scale)
        os.environ.pop("MIXKV_CPU_SIMD")
        identical_simd &= bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
    rel = float(np.linalg.norm(got2 - want) / np.linalg.norm(want))

    rows = []
    base = {t: statistics.median(samples[("numpy f32", t)]) for t in (1, 2)}
    for (case, threads), xs in samples.items():
        ms = statistics.median(xs)
        rows.append(
            {
                "shape": name,
                "batch": batch,
                "tokens": tokens,
                "case": case,
                "threads": threads,
                "ms": ms,
                "x_numpy_f32": ms / base[threads],
                "samples_ms": xs,
            }
        )
    checks = {
        "shape": name,
        "batch": batch,
        "tokens": tokens,
        "fp16_vs_numpy_rel_error": rel,
        "threads_1_vs_2_bit_identical": identical_threads,
        "avx2_vs_portable_bit_identical": identical_simd,
    }
    return rows, checks


def write_outputs(result):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "cpu_decode_vs_numpy.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    shapes = []
    for r in rows:
        key = (r["shape"], r["batch"], r["tokens"])
        if key not in shapes:
            shapes.append(key)
    order = PLANS + ["numpy f32", "numpy f16"]
    lines = [
        "| shape | batch x tokens | case | 1 thread (ms) | 2 threads (ms) | 1 thread / numpy f32 1 thread "
        "| 2 threads / best numpy f32 |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for shape, batch, tokens in shapes:
        ms = {
            (r["case"], r["threads"]): r["ms"]
            for r in rows
            if (r["shape"], r["batch"], r["tokens"]) == (shape, batch, tokens)
        }
        best = min(ms[("numpy f32", 1)], ms[("numpy f32", 2)])
        for case in order:
            name = case if case.startswith("numpy") else "mixkv " + case
            lines.append(
                f"| {shape} | {batch} x {tokens:,} | {name} | {ms[(case, 1)]:.2f} | {ms[(case, 2)]:.2f} | "
                f"{ms[(case, 1)] / ms[('numpy f32', 1)]:.3f} | {ms[(case, 2)] / best:.3f} |"
            )
    load = result["machine"]["load_avg_before"], result["machine"]["load_avg_after"]
    lines += [
        "",
        f"Medians of {result['reps']} alternating repetitions; load average (1/5/15 min) "
        f"{' / '.join(f'{x:.2f}' for x in load[0])} before, {' / '.join(f'{x:.2f}' for x in load[1])} after; "
        f"{result['machine']['cpus']} CPUs; NumPy {result['numpy']} with {result['blas'].get('internal_api')} "
        f"({result['blas'].get('architecture', '?')} kernel).",
    ]
    for c in result["checks"]:
        lines.append(
            f"Check {c['shape']} {c['batch']} x {c['tokens']}: FP16 vs NumPy relative error "
            f"{c['fp16_vs_numpy_rel_error']:.1e}; 1 vs 2 threads bit-identical: "
            f"{c['threads_1_vs_2_bit_identical']}; AVX2 vs portable bit-identical: "
            f"{c['avx2_vs_portable_bit_identical']}."
        )
    with open(os.path.join(RESULTS, "cpu_decode_vs_numpy.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4), squeeze=False)
    for ax, (shape, batch, tokens) in zip(axes[0], shapes):
        x = np.arange(len(order))
        for i, threads in enumerate((1, 2)):
            ys = [
                next(
                    r["ms"]
                    for r in rows
                    if (r["shape"], r["batch"], r["tokens"], r["case"], r["threads"])
                    == (shape, batch, tokens, case, threads)
                )
                for case in order
            ]
            ax.bar(x + (i - 0.5) * 0.4, ys, 0.4, label=f"{threads} thread{'s' if threads > 1 else ''}")
        ax.set_xticks(x, [c.replace("numpy ", "np ") for c in order], rotation=45)
        ax.set_title(f"{shape}, {batch} x {tokens}", fontsize=9)
        ax.set_ylabel("ms per layer (median)")
        ax.set_yscale("log")
    axes[0][0].legend()
    fig.suptitle("mixkv CPU decode attention vs dense NumPy, same data")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "cpu_decode_vs_numpy.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B shape only")
    args = parser.parse_args()
    shapes = [("Llama-3-8B 32/8x128", 32, 8, 128, 8, 2048)]
    if not args.quick:
        shapes += [
            ("SmolLM2 9/3x64", 9, 3, 64, 1, 512),
            ("SmolLM2 9/3x64", 9, 3, 64, 1, 4096),
            ("SmolLM2 9/3x64", 9, 3, 64, 8, 2048),
        ]
    blas = BlasThreads()
    rng = np.random.default_rng(2024)
    load_before = os.getloadavg()
    rows, checks = [], []
    for shape in shapes:
        r, c = run_shape(*shape, args.reps, blas, rng)
        rows += r
        checks.append(c)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(),
        },
        "numpy": np.__version__,
        "blas": blas.info,
        "dropped_env": DROPPED_ENV,
        "reps": args.reps,
        "block_size": BLOCK,
        "rows": rows,
        "checks": checks,
    }
    write_outputs(result)


if __name__ == "__main__":
    main()
