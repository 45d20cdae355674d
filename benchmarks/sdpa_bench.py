"""Dense FP16 decode baseline through torch SDPA (enable_gqa=True), timed the
way decode_bench times mixkv: L2 flushed before each launch (by reading a
256 MiB buffer, or with --flush write by zeroing it), CUDA events, median of N. Shape: 28 query / 4 KV heads, head_dim 128 unless
--heads Q/KV and --head-dim say otherwise (decode_bench takes the same).
Writes JSON: [{batch, context, sdpa_us}]."""

import argparse
import json

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa_bench.json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--flush", choices=["read", "write"], default="read")
    ap.add_argument("--heads", default="28/4", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256])
    ap.add_argument("--batches", help="comma-separated, e.g. 1,64")
    ap.add_argument("--contexts", help="comma-separated, e.g. 19600")
    args = ap.parse_args()
    q_heads, kv_heads = (int(x) for x in args.heads.split("/"))
    if kv_heads < 1 or q_heads < 1 or q_heads % kv_heads:
        ap.error(f"--heads: expected Q/KV with Q a positive multiple of KV, got {args.heads}")
    dim = args.head_dim
    batches, contexts = ([1, 64], [19600]) if args.quick else ([1, 8, 64], [4096, 19600, 65536])
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    flush = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
    results = []
    for ctx in contexts:
        for b in batches:
            q = torch.randn(b, q_heads, 1, dim, dtype=torch.float16, device="cuda")
            k = torch.randn(b, kv_heads, ctx, dim, dtype=torch.float16, device="cuda")
            v = torch.randn(b, kv_heads, ctx, dim, dtype=torch.float16, device="cuda")
            times = []
            for i in range(args.reps + 3):
                if args.flush == "read":
                    flush.sum()
                else:
                    flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                stop.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(stop) * 1000.0)
            times.sort()
            us = times[len(times) // 2]
            results.append({"batch": b, "context": ctx, "sdpa_us": us})
            print(f"sdpa batch {b:3d} context {ctx:6d}: {us:9.1f} us", flush=True)
            del q, k, v
    with open(args.out, "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "l2_flush": args.flush,
                "shape": {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": dim},
                "sdpa": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
