"""Short summary of decode_bench.json (+ sdpa_bench.json): the issue-3
targets at batch 64 x 19,600 and batch 1 x 19,600. Also used by plot_decode.py."""

import json
import os
import sys


def load(bench_path, sdpa_path=None):
    bench = json.load(open(bench_path))
    sdpa = {}
    if sdpa_path and os.path.exists(sdpa_path):
        for r in json.load(open(sdpa_path))["sdpa"]:
            sdpa[(r["batch"], r["context"])] = r["sdpa_us"]
    return bench, sdpa


def rows(bench, sdpa):
    dense = {(r["batch"], r["context"]): r["time_us"] for r in bench["decode"] if r["plan"] == "dense_cublas_fp16"}
    out = []
    for r in bench["decode"]:
        key = (r["batch"], r["context"])
        row = dict(r)
        row["ratio_dense"] = r["time_us"] / dense[key]
        row["sdpa_us"] = sdpa.get(key)
        row["ratio_sdpa"] = r["time_us"] / sdpa[key] if key in sdpa else None
        # a row merged in from another run keeps that run's ceiling
        row["pct_bw"] = 100.0 * r["gbps"] / r.get("read_bandwidth_gbps", bench["read_bandwidth_gbps"])
        out.append(row)
    return out


def main():
    bench, sdpa = load(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    bw = bench["read_bandwidth_gbps"]
    print(f"\nread bandwidth {bw:.0f} GB/s ({bench['device']})")
    print(f"{'batch':>5} {'ctx':>6} {'plan':>18} {'us':>9} {'GB/s':>7} {'%BW':>6} {'x dense':>8} {'x sdpa':>7}")
    for r in rows(bench, sdpa):
        s = f"{r['ratio_sdpa']:.3f}" if r["ratio_sdpa"] is not None else "-"
        print(
            f"{r['batch']:5d} {r['context']:6d} {r['plan']:>18} {r['time_us']:9.1f} {r['gbps']:7.0f} "
            f"{r['pct_bw']:5.1f}% {r['ratio_dense']:8.3f} {s:>7}"
        )
    for r in bench.get("store_prefill", []):
        read_us = r.get("read_same_bytes_us")
        same = (
            f"; a read of its bytes {read_us:.1f} us, store at {100.0 * read_us / r['time_us']:.0f}%" if read_us else ""
        )
        print(
            f"store_prefill ctx {r['context']:6d} {r['plan']:>6}: {r['time_us']:8.1f} us "
            f"{r['gbps']:6.0f} GB/s {r['pct_bw']:5.1f}%{same}"
        )


if __name__ == "__main__":
    main()
