"""Short summary of one device run's decode_bench.json (+ sdpa_bench.json,
+ flashinfer_decode_bench.json): every plan's time against dense cuBLAS,
SDPA and FlashInfer's FP16 and FP8 paged decode of the same run, and the
batch-invariant splits against the automatic plan. --out writes the three
merged (what plot_decode.py reads). Also used by plot_decode.py.

    python3 benchmarks/summarize.py RUN/decode_bench.json [RUN/sdpa_bench.json]
        [--flashinfer RUN/flashinfer_decode_bench.json] [--out RUN/decode.json]
"""

import argparse
import json
import os

FI_COLUMNS = {"fp16": "flashinfer_fp16", "fp8": "flashinfer_fp8"}


def load(bench_path, sdpa_path=None, flashinfer_path=None):
    """(bench, sdpa {(batch, ctx): us}, flashinfer {(batch, ctx, variant): entry}, flashinfer run or None).

    A merged decode.json (plot_decode.py's output) carries its SDPA and FlashInfer times itself."""
    bench = json.load(open(bench_path))
    sdpa = {}
    for r in bench.get("sdpa_us", []):
        sdpa[(r["batch"], r["context"])] = r["sdpa_us"]
    if sdpa_path and os.path.exists(sdpa_path):
        for r in json.load(open(sdpa_path))["sdpa"]:
            sdpa[(r["batch"], r["context"])] = r["sdpa_us"]
    fi_run = bench.get("flashinfer_run")
    fi = {}
    for r in bench.get("flashinfer", []):
        fi[(r["batch"], r["context"], r["variant"])] = r
    if flashinfer_path and os.path.exists(flashinfer_path):
        fi_run = json.load(open(flashinfer_path))
        fi = {(r["batch"], r["context"], r["variant"]): r for r in fi_run.get("results", []) if "time_us" in r}
    return bench, sdpa, fi, fi_run


def rows(bench, sdpa, fi=None):
    fi = fi or {}
    dense = {(r["batch"], r["context"]): r["time_us"] for r in bench["decode"] if r["plan"] == "dense_cublas_fp16"}
    out = []
    for r in bench["decode"]:
        key = (r["batch"], r["context"])
        row = dict(r)
        row["ratio_dense"] = r["time_us"] / dense[key]
        row["sdpa_us"] = sdpa.get(key)
        row["ratio_sdpa"] = r["time_us"] / sdpa[key] if key in sdpa else None
        for variant, column in FI_COLUMNS.items():
            f = fi.get((*key, variant))
            row[f"{column}_us"] = f["time_us"] if f else None
            row[f"ratio_{column}"] = r["time_us"] / f["time_us"] if f else None
        # a row merged in from another run keeps that run's ceiling
        row["pct_bw"] = 100.0 * r["gbps"] / r.get("read_bandwidth_gbps", bench["read_bandwidth_gbps"])
        out.append(row)
    return out


def merged(bench, sdpa, fi, fi_run):
    """decode.json: the bench with every ratio of this run, SDPA and FlashInfer times beside it."""
    m = dict(bench)
    m["decode"] = rows(bench, sdpa, fi)
    m["sdpa_us"] = [{"batch": b, "context": c, "sdpa_us": t} for (b, c), t in sorted(sdpa.items())]
    m["flashinfer"] = [fi[k] for k in sorted(fi)]
    if fi_run is not None:
        m["flashinfer_run"] = {k: v for k, v in fi_run.items() if k != "results"}
    return m


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench")
    ap.add_argument("sdpa", nargs="?")
    ap.add_argument("--flashinfer", help="flashinfer_decode_bench.json of the same run")
    ap.add_argument("--out", help="write the merged JSON here")
    args = ap.parse_args()
    bench, sdpa, fi, fi_run = load(args.bench, args.sdpa, args.flashinfer)
    bw = bench["read_bandwidth_gbps"]
    print(f"\nread bandwidth {bw:.0f} GB/s ({bench['device']})")
    if fi_run is not None and fi_run.get("skipped"):
        print(f"FlashInfer decode: skipped ({fi_run['skipped']})")
    elif fi_run is None:
        print("FlashInfer decode: no results (not run)")
    else:
        print(f"FlashInfer {fi_run.get('flashinfer', '?')} paged decode (tensor cores), same run: x fi16 / x fi8")
    print(
        f"{'batch':>5} {'ctx':>6} {'plan':>18} {'us':>9} {'GB/s':>7} {'%BW':>6} {'x dense':>8} {'x sdpa':>7} "
        f"{'x fi16':>7} {'x fi8':>7}"
    )
    for r in rows(bench, sdpa, fi):
        print(
            f"{r['batch']:5d} {r['context']:6d} {r['plan']:>18} {r['time_us']:9.1f} {r['gbps']:7.0f} "
            f"{r['pct_bw']:5.1f}% {r['ratio_dense']:8.3f} {fmt(r['ratio_sdpa']):>7} "
            f"{fmt(r['ratio_flashinfer_fp16']):>7} {fmt(r['ratio_flashinfer_fp8']):>7}"
        )
    for (b, c, v), f in sorted(fi.items()):
        print(f"flashinfer {v:>13} batch {b:3d} ctx {c:6d}: {f['time_us']:9.1f} us {f['gbps']:7.0f} GB/s")
    for r in bench.get("batch_invariant", []):
        print(
            f"batch-invariant {r['batch_invariant_blocks']:3d} blocks: batch {r['batch']:3d} ctx {r['context']:6d} "
            f"{r['plan']:>6} {r['time_us']:9.1f} us = {r['ratio_auto']:.3f} x the automatic plan "
            f"({r['items']} items, automatic {r['auto_items']})"
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(merged(bench, sdpa, fi, fi_run), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
