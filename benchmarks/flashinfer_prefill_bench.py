"""FlashInfer's paged prefill (BatchPrefillWithPagedKVCacheWrapper, 0.7.2.post1)
and torch SDPA on the shapes of extend_bench.cpp, timed the same way: L2
flushed before each launch (reading a 256 MiB buffer, or with --flush write
zeroing it), CUDA events, median of --reps after 3 warm-ups; plan() not timed.

Shapes (28 query / 4 KV heads, head_dim 128): chunk2048_b1, chunk2048_b8
(2,048 new rows over 19,600 cached tokens at batch 1 and 8), chunk512_b32
(512 over 4,096 at batch 32), verify8_b64 (8 over 19,600 at batch 64).

Semantics: the new rows' K/V are appended to the paged cache, so each
sequence's kv_len = ctx + n and qo_len = n; FlashInfer's causal mask aligns
the query rows to the END of the kv sequence (row i sees kv positions
<= ctx + i), which is exactly mixkv's extend (all cached tokens, the new
rows causally). The append itself is not timed (mixkv's extend does not
write the cache either). Page ids are a random permutation of the pool.

Variants: fp16_fa2, fp16_fa3 (FP16 KV; FlashInfer's "auto" picks fa3 on
sm90), fp8_fa2 (e4m3 KV with FP16 queries, scale 1; fa3 would need FP8
queries), sdpa (torch SDPA on dense per-batch K/V with
torch.nn.attention.bias.causal_lower_right and enable_gqa, fused kernels
only; if no fused kernel takes it the K/V heads are repeated, and the
entry says so; skipped with a message when neither runs).

  TFLOP/s = 4 * num_q_heads * head_dim * sum_i n_i * (ctx_i + (n_i + 1) / 2) / time
  bytes_read = K/V of every sequence's ctx + n tokens at the KV dtype + q
               + 4 B a page index (once each)

--compile-only builds the JIT modules of the chosen variants (in parallel)
and exits: extend_on_device.sh runs it while mixkv builds. FlashInfer's JIT
workspace goes to $FLASHINFER_WORKSPACE_BASE (default /tmp/fi-ws).
Writes JSON (--out).
"""

import argparse
import json
import math
import os
import sys

import flashinfer_common
from flashinfer_common import build_modules, is_built

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi-ws")

# FlashInfer's JIT compiles against the DLPack header apache-tvm-ffi ships; an
# include path inherited from the caller (CPATH naming an older dlpack.h, as a
# mixkv build may use) would shadow it and every module would fail to compile.
for _var in ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
    os.environ.pop(_var, None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
SHAPES = {
    "chunk2048_b1": (1, 2048, 19600),
    "chunk2048_b8": (8, 2048, 19600),
    "chunk512_b32": (32, 512, 4096),
    "verify8_b64": (64, 8, 19600),
}
FI_VARIANTS = {  # name: (backend, kv dtype)
    "fp16_fa2": ("fa2", torch.float16),
    "fp16_fa3": ("fa3", torch.float16),
    "fp8_fa2": ("fa2", torch.float8_e4m3fn),
}
ALL_VARIANTS = list(FI_VARIANTS) + ["sdpa"]
SLEEP_CYCLES = 400_000  # ~200 us at ~2 GHz


def module_args(kv_dtype):
    # What BatchPrefillWithPagedKVCacheWrapper.plan passes get_batch_prefill_module:
    # q, kv, o dtypes, index dtype, head dims, no rope, no sliding window, no soft cap, no fp16 qk.
    return (torch.float16, kv_dtype, torch.float16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False)


def prefill_specs(variants):
    """{variant: the JIT spec its wrapper loads} for the FlashInfer variants."""
    from flashinfer.jit.attention import modules as M

    specs = {}
    for v in variants:
        if v not in FI_VARIANTS:
            continue
        backend, kv = FI_VARIANTS[v]
        # The wrapper's fa2 path loads the "primary" (equal-stride) module; fa3 the full one.
        gen = getattr(M, "_gen_batch_prefill_primary_module", None) if backend == "fa2" else None
        gen = gen or M.gen_batch_prefill_module
        specs[v] = gen(backend, *module_args(kv))
    return specs


def compile_modules(variants):
    """Builds the prefill JIT modules of `variants` concurrently (one ninja each)."""
    build_modules(prefill_specs(variants))


def median_us(fn, reps, flush):
    return flashinfer_common.median_us(torch, fn, reps, flush, SLEEP_CYCLES)


def flops_of(batch, n, ctx):
    return 4.0 * Q_HEADS * HEAD_DIM * batch * n * (ctx + (n + 1) / 2.0)


def read_bandwidth(flush):
    """A read-and-reduce over 4 GiB (torch's sum): bytes per second."""
    buf = torch.ones(2 << 30, dtype=torch.float16, device="cuda")
    us = median_us(buf.sum, 10, flush)
    buf = None
    torch.cuda.empty_cache()
    return (4 << 30) / us * 1e6


def bench_flashinfer(flashinfer, name, shape, page, layout, caches, reps, flush, workspace):
    batch, n, ctx = shape
    backend, kv_dtype = FI_VARIANTS[name]
    q, out, qo_indptr, kv_indptr, kv_indices, last_len = caches["common"]
    k, v = caches[kv_dtype]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=layout, backend=backend)
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_len,
        Q_HEADS,
        KV_HEADS,
        HEAD_DIM,
        page,
        causal=True,
        sm_scale=1.0 / math.sqrt(HEAD_DIM),
        q_data_type=torch.float16,
        kv_data_type=kv_dtype,
    )
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    us = median_us(lambda: wrapper.run(q, (k, v), out=out), reps, flush)
    finite = bool(torch.isfinite(out).all().item())
    kv_len = ctx + n
    elem = torch.empty((), dtype=kv_dtype).element_size()
    bytes_read = batch * kv_len * KV_HEADS * HEAD_DIM * 2 * elem + q.numel() * 2 + kv_indices.numel() * 4
    return {
        "backend": backend,
        "backend_resolved": getattr(wrapper, "_backend", backend),
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "time_us": us,
        "bytes_read": bytes_read,
        "finite": finite,
    }


def bench_sdpa(shape, reps, flush):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    batch, n, ctx = shape
    kv_len = ctx + n
    q = torch.randn(batch, Q_HEADS, n, HEAD_DIM, dtype=torch.float16, device="cuda")
    k = torch.randn(batch, KV_HEADS, kv_len, HEAD_DIM, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    bias = causal_lower_right(n, kv_len)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    bytes_read = (q.numel() + k.numel() + v.numel()) * 2
    try:
        with sdpa_kernel(fused):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)  # noqa: E731
            fn()
            us = median_us(fn, reps, flush)
            finite = bool(torch.isfinite(fn()).all().item())
        path = "gqa"
    except Exception as e:  # RuntimeError "no available kernel", or a torch without GQA for CausalBias
        # No fused kernel for lower-right causal with GQA: repeat the K/V heads.
        print(f"  sdpa: GQA path unavailable ({str(e).splitlines()[0][:120]}); repeating K/V heads", flush=True)
        group = Q_HEADS // KV_HEADS
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        with sdpa_kernel(fused):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa: E731
            fn()
            us = median_us(fn, reps, flush)
            finite = bool(torch.isfinite(fn()).all().item())
        path = "kv_repeated"
        bytes_read = (q.numel() + k.numel() + v.numel()) * 2
    return {
        "backend": "sdpa",
        "path": path,
        "kv_dtype": "float16",
        "time_us": us,
        "bytes_read": bytes_read,
        "finite": finite,
    }


def report(entry):
    """Adds TFLOP/s and GB/s to a timed entry and prints its line."""
    s = entry["shape"]
    if "time_us" not in entry:
        print(f"{s:13s} {entry['variant']:9s} skipped: {entry.get('error', '')[:200]}", flush=True)
        return entry
    us = entry["time_us"]
    entry["tflops"] = entry["flops"] / us / 1e6
    entry["gbps"] = entry["bytes_read"] / us / 1e3
    print(
        f"{s:13s} {entry['variant']:9s} {entry.get('page_size', '-')!s:>4s} "
        f"{entry.get('layout', '-'):6s} {us:10.1f} {entry['tflops']:8.1f} "
        f"{entry['bytes_read'] / 1e6:9.1f} {entry['gbps']:8.1f}"
        f"{'' if entry.get('finite', True) else '  NON-FINITE'}",
        flush=True,
    )
    return entry


def make_caches(shape, page, layout, kv_dtypes):
    batch, n, ctx = shape
    kv_len = ctx + n
    pages_per_seq = -(-kv_len // page)
    total = batch * pages_per_seq
    dev = "cuda"
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * n
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages_per_seq
    kv_indices = torch.randperm(total, device=dev).to(torch.int32)  # shuffled pages
    last_len = torch.full((batch,), kv_len - (pages_per_seq - 1) * page, dtype=torch.int32, device=dev)
    dims = (total, page, KV_HEADS, HEAD_DIM) if layout == "NHD" else (total, KV_HEADS, page, HEAD_DIM)
    k = torch.randn(dims, dtype=torch.float16, device=dev)
    v = torch.randn(dims, dtype=torch.float16, device=dev)
    q = torch.randn(batch * n, Q_HEADS, HEAD_DIM, dtype=torch.float16, device=dev)
    out = torch.empty_like(q)
    caches = {"common": (q, out, qo_indptr, kv_indptr, kv_indices, last_len)}
    for dt in kv_dtypes:
        caches[dt] = (k, v) if dt == torch.float16 else (k.to(dt), v.to(dt))
    return caches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="flashinfer_prefill_bench.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 reps, no SDPA")
    ap.add_argument("--flush", choices=["read", "write"], default="read")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS), help="comma-separated: " + ",".join(ALL_VARIANTS))
    ap.add_argument("--page-sizes", default="16", help="comma-separated, 16 and/or 32")
    ap.add_argument("--layouts", default="HND", help="comma-separated, HND and/or NHD")
    ap.add_argument("--compile-only", action="store_true", help="build the JIT modules and exit")
    ap.add_argument(
        "--require-built",
        action="store_true",
        help="skip (and say so) FlashInfer variants whose JIT module is not built yet, instead of building it",
    )
    ap.add_argument(
        "--sdpa-max-gb",
        type=float,
        default=40.0,
        help="skip SDPA where dense q/K/V (K/V repeated if needed) would exceed this",
    )
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown {s}")
    for v in variants:
        if v not in ALL_VARIANTS:
            ap.error(f"--variants: unknown {v}")
    if args.quick:
        args.reps = min(args.reps, 5)
        variants = [v for v in variants if v != "sdpa"]
    pages = [int(p) for p in args.page_sizes.split(",")]
    layouts = args.layouts.split(",")

    import flashinfer

    flashinfer_common.announce(flashinfer, torch)
    if args.compile_only:
        flashinfer_common.compile_only(lambda: compile_modules(variants))
        return

    if not torch.cuda.is_available():
        print("no CUDA device: benchmark skipped")
        return
    unbuilt = set()
    if args.require_built:
        unbuilt = {v for v, spec in prefill_specs(variants).items() if not is_built(spec)}
        if unbuilt:
            print(f"JIT modules not built, skipped: {', '.join(sorted(unbuilt))}", flush=True)
    else:
        try:  # a no-op when --compile-only ran before
            compile_modules(variants)
        except Exception as e:  # the wrappers build on first use anyway
            print(f"parallel JIT build failed ({e}); building on first use", flush=True)

    flush_buf = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB

    def flush():
        if args.flush == "read":
            flush_buf.sum()
        else:
            flush_buf.zero_()

    bw = read_bandwidth(flush)
    print(
        f"device {torch.cuda.get_device_name()}: torch read bandwidth (sum over 4 GiB) {bw / 1e9:.0f} GB/s", flush=True
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []

    def dump():
        # Rewritten after every entry: a run cut short by a timeout keeps what it measured.
        with open(args.out, "w") as f:
            json.dump(
                {
                    "flashinfer": flashinfer.__version__,
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(),
                    "torch_read_bandwidth_gbps": bw / 1e9,
                    "l2_flush": args.flush,
                    "reps": args.reps,
                    "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
                    "flops_formula": "4 * num_q_heads * head_dim * sum_i n_i * (ctx_i + (n_i + 1) / 2)",
                    "bytes_read_formula": "K/V of ctx + n tokens per sequence at the KV dtype + q + 4 B a page index",
                    "semantics": "kv_len = ctx + n (new rows appended, append not timed), qo_len = n, causal=True "
                    "(aligned to the end of kv)",
                    "results": results,
                },
                f,
                indent=1,
            )

    print(
        f"{'shape':13s} {'variant':9s} {'page':>4s} {'layout':6s} {'time_us':>10s} {'TFLOP/s':>8s} "
        f"{'MB_read':>9s} {'GB/s':>8s}",
        flush=True,
    )
    for s in shapes:
        shape = SHAPES[s]
        batch, n, ctx = shape
        flops = flops_of(batch, n, ctx)
        base = {"shape": s, "batch": batch, "n_new": n, "context": ctx, "flops": flops}

        def record(entry, base=base):
            results.append(report({**base, **entry}))
            dump()

        fi_variants = [v for v in variants if v in FI_VARIANTS]
        for page in pages:
            for layout in layouts:
                if not fi_variants:
                    continue
                kv_dtypes = sorted({FI_VARIANTS[v][1] for v in fi_variants}, key=str)
                caches = make_caches(shape, page, layout, kv_dtypes)
                for v in fi_variants:
                    meta = {"variant": v, "page_size": page, "layout": layout}
                    if v in unbuilt:
                        record({**meta, "error": "JIT module not built in time (extend_on_device.sh's deadline)"})
                        continue
                    try:
                        record(
                            {
                                **meta,
                                **bench_flashinfer(
                                    flashinfer, v, shape, page, layout, caches, args.reps, flush, workspace
                                ),
                            }
                        )
                    except Exception as e:  # one failing variant must not end the run
                        record({**meta, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                    torch.cuda.synchronize()
                del caches
                torch.cuda.empty_cache()
        if "sdpa" in variants:
            kv_len = ctx + n
            dense_gb = batch * (Q_HEADS * n + 2 * Q_HEADS * kv_len) * HEAD_DIM * 2 / 1e9  # worst case: K/V repeated
            if dense_gb > args.sdpa_max_gb:
                record({"variant": "sdpa", "error": f"dense tensors ~{dense_gb:.0f} GB over --sdpa-max-gb"})
            else:
                try:
                    record({"variant": "sdpa", **bench_sdpa(shape, args.reps, flush)})
                except Exception as e:
                    record({"variant": "sdpa", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
                torch.cuda.empty_cache()

    dump()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
