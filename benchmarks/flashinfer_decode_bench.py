"""FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper, 0.7.2.post1,
use_tensor_cores=True: the FA2 prefill kernel with one query row per
sequence) on the shapes of decode_bench.cpp, timed the same way: L2 flushed
before each launch (reading a 256 MiB buffer, or with --flush write zeroing
it; decode_bench reads 4x the L2 size), CUDA events, median of --reps after
3 warm-ups; plan() not timed (mixkv's plan() is host work too).

Shapes: 28 query / 4 KV heads, head_dim 128, pages of 32 tokens (mixkv's
block), HND layout (a page is [kv_head][token][dim], as a mixkv block);
batch 1, 8, 64 x context 4,096, 19,600, 65,536 (--quick: 1, 64 x 19,600).
Page ids are a random permutation of the pool, as decode_bench shuffles its
block ids.

Variants:
  fp16          FP16 K/V and queries
  fp8           e4m3 K/V with FP16 queries and per-tensor scales, the scale
                path FlashInfer's FA2 decode supports: k_scale folded into
                sm_scale, v_scale a multiply of the output after the kernel
                (one more launch, timed with it, as a caller pays it)
  fp16_split16  fp16 with fixed_split_size=16 pages: FlashInfer's
                batch-invariant control, beside mixkv's batch_invariant_blocks

  bytes_read = K/V of every sequence's tokens at the KV dtype + q + 4 B a page index

--compile-only builds the JIT modules of the chosen variants (in parallel)
and exits: run_on_device.sh runs it while mixkv builds. --require-built
skips (and says so) a variant whose module is not built instead of building
it while anything is timed. FlashInfer's JIT workspace goes to
$FLASHINFER_WORKSPACE_BASE (default /tmp/fi-ws). Without flashinfer (or
without a GPU) it prints why and writes a JSON that says so. Writes JSON
(--out), rewritten after every entry.
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

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 32
BATCHES, CONTEXTS = [1, 8, 64], [4096, 19600, 65536]
VARIANTS = ["fp16", "fp8", "fp16_split16"]
SPLIT_PAGES = 16  # fp16_split16's fixed_split_size
# Keeps the GPU busy (~500 us at ~2 GHz) while Python enqueues the timed
# launch, so that the wrapper's host time is not timed (mixkv's C++ run()
# pays a few us): a decode at batch 1 takes 10-40 us.
SLEEP_CYCLES = 1_000_000
FP8_MAX = 448.0  # largest finite e4m3


def kv_dtype_of(variant, torch):
    return torch.float8_e4m3fn if variant == "fp8" else torch.float16


def decode_spec(kv_dtype, torch):
    """The JIT spec the tensor-core decode wrapper loads on its fa2 path (get_batch_prefill_module)."""
    from flashinfer.jit.attention import modules as M

    gen = getattr(M, "_gen_batch_prefill_primary_module", None) or M.gen_batch_prefill_module
    # q, kv, o dtypes, index dtype, head dims, no rope, no sliding window, no soft cap, no fp16 qk.
    return gen("fa2", torch.float16, kv_dtype, torch.float16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False)


def specs_of(variants, torch):
    return {str(kv): decode_spec(kv, torch) for kv in {kv_dtype_of(v, torch) for v in variants}}


def compile_modules(variants, torch):
    """Builds the decode JIT modules of `variants` concurrently (one ninja each)."""
    build_modules(specs_of(variants, torch))


def median_us(torch, fn, reps, flush):
    return flashinfer_common.median_us(torch, fn, reps, flush, SLEEP_CYCLES)


def make_cache(torch, batch, ctx, want_fp8):
    """Pages of `batch` sequences of `ctx` tokens, shuffled over the pool, HND."""
    pages_per_seq = -(-ctx // PAGE)
    total = batch * pages_per_seq
    dev = "cuda"
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages_per_seq
    indices = torch.randperm(total, device=dev).to(torch.int32)
    last_len = torch.full((batch,), ctx - (pages_per_seq - 1) * PAGE, dtype=torch.int32, device=dev)
    k = torch.randn(total, KV_HEADS, PAGE, HEAD_DIM, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    cache = {"indptr": indptr, "indices": indices, "last_len": last_len, torch.float16: (k, v, None, None)}
    if want_fp8:
        # Per-tensor scales: the largest |value| maps to e4m3's largest finite.
        k_scale = float(k.abs().max().item()) / FP8_MAX
        v_scale = float(v.abs().max().item()) / FP8_MAX
        k8 = (k / k_scale).to(torch.float8_e4m3fn)
        v8 = (v / v_scale).to(torch.float8_e4m3fn)
        cache[torch.float8_e4m3fn] = (k8, v8, k_scale, v_scale)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.float16, device=dev)
    cache["q"] = q
    cache["out"] = torch.empty_like(q)
    return cache


def bench_variant(torch, flashinfer, variant, batch, ctx, cache, reps, flush, workspace):
    kv_dtype = kv_dtype_of(variant, torch)
    k, v, k_scale, v_scale = cache[kv_dtype]
    q, out = cache["q"], cache["out"]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout="HND", use_tensor_cores=True, backend="fa2"
    )
    extra = {"fixed_split_size": SPLIT_PAGES} if variant == "fp16_split16" else {}
    wrapper.plan(
        cache["indptr"],
        cache["indices"],
        cache["last_len"],
        Q_HEADS,
        KV_HEADS,
        HEAD_DIM,
        PAGE,
        q_data_type=torch.float16,
        kv_data_type=kv_dtype,
        o_data_type=torch.float16,
        sm_scale=1.0 / math.sqrt(HEAD_DIM),
        **extra,
    )
    torch.cuda.synchronize()
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    out.fill_(float("nan"))
    us = median_us(torch, lambda: wrapper.run(q, (k, v), out=out, **scales), reps, flush)
    finite = bool(torch.isfinite(out).all().item())
    elem = torch.empty((), dtype=kv_dtype).element_size()
    bytes_read = batch * ctx * KV_HEADS * HEAD_DIM * 2 * elem + q.numel() * 2 + cache["indices"].numel() * 4
    entry = {
        "batch": batch,
        "context": ctx,
        "variant": variant,
        "backend": getattr(wrapper, "_backend", "fa2"),
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "page_size": PAGE,
        "layout": "HND",
        "time_us": us,
        "bytes_read": bytes_read,
        "gbps": bytes_read / us / 1e3,
        "finite": finite,
    }
    if extra:
        entry["fixed_split_size"] = SPLIT_PAGES
    if scales:
        entry["scales"] = "per-tensor k_scale (in sm_scale) and v_scale (out *= v_scale after the kernel, timed)"
    return entry


def write(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="flashinfer_decode_bench.json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64 at 19,600 tokens")
    ap.add_argument("--flush", choices=["read", "write"], default="read")
    ap.add_argument("--batches", help="comma-separated, e.g. 1,64")
    ap.add_argument("--contexts", help="comma-separated, e.g. 19600")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--compile-only", action="store_true", help="build the JIT modules and exit")
    ap.add_argument(
        "--require-built",
        action="store_true",
        help="skip (and say so) variants whose JIT module is not built yet, instead of building it",
    )
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v}: expected some of {','.join(VARIANTS)}")
    batches, contexts = ([1, 64], [19600]) if args.quick else (BATCHES, CONTEXTS)
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]

    base = {
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE},
        "l2_flush": args.flush,
        "reps": args.reps,
        "bytes_read_formula": "K/V of every sequence's tokens at the KV dtype + q + 4 B a page index",
        "results": [],
    }
    try:
        import flashinfer
        import torch
    except Exception as e:  # no wheel on this machine: say so, and leave a JSON that says so
        print(f"FlashInfer decode skipped: {type(e).__name__}: {e}", flush=True)
        if not args.compile_only:
            write(args.out, {**base, "skipped": f"{type(e).__name__}: {e}"})
        return 0

    flashinfer_common.announce(flashinfer, torch)
    if args.compile_only:
        flashinfer_common.compile_only(lambda: compile_modules(variants, torch))
        return 0
    if not torch.cuda.is_available():
        print("FlashInfer decode skipped: no CUDA device")
        write(args.out, {**base, "skipped": "no CUDA device"})
        return 0

    unbuilt = set()
    if args.require_built:
        specs = specs_of(variants, torch)
        unbuilt = {v for v in variants if not is_built(specs[str(kv_dtype_of(v, torch))])}
        if unbuilt:
            print(f"JIT modules not built, skipped: {', '.join(sorted(unbuilt))}", flush=True)

    flush_buf = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB

    def flush():
        if args.flush == "read":
            flush_buf.sum()
        else:
            flush_buf.zero_()

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    payload = {
        **base,
        "flashinfer": flashinfer.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    results = payload["results"]
    print(f"{'batch':>5} {'context':>7} {'variant':>13} {'time_us':>10} {'MB_read':>9} {'GB/s':>8}", flush=True)
    for ctx in contexts:
        for batch in batches:
            cache = make_cache(torch, batch, ctx, "fp8" in variants and "fp8" not in unbuilt)
            for variant in variants:
                if variant in unbuilt:
                    entry = {"batch": batch, "context": ctx, "variant": variant, "error": "JIT module not built"}
                else:
                    try:
                        entry = bench_variant(
                            torch, flashinfer, variant, batch, ctx, cache, args.reps, flush, workspace
                        )
                    except Exception as e:  # one failing variant must not end the run
                        entry = {
                            "batch": batch,
                            "context": ctx,
                            "variant": variant,
                            "error": f"{type(e).__name__}: {str(e)[:400]}",
                        }
                results.append(entry)
                write(args.out, payload)
                if "time_us" in entry:
                    print(
                        f"{batch:5d} {ctx:7d} {variant:>13} {entry['time_us']:10.1f} "
                        f"{entry['bytes_read'] / 1e6:9.1f} {entry['gbps']:8.1f}"
                        f"{'' if entry['finite'] else '  NON-FINITE'}",
                        flush=True,
                    )
                else:
                    print(f"{batch:5d} {ctx:7d} {variant:>13} skipped: {entry['error'][:200]}", flush=True)
                torch.cuda.synchronize()
            del cache
            torch.cuda.empty_cache()
    write(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
