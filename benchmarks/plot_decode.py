"""Plots and tabulates a device run of decode_bench (+ sdpa_bench), run here
on the fetched JSON:
    python3 benchmarks/plot_decode.py RUN/decode_bench.json RUN/sdpa_bench.json
writes benchmarks/results/decode.png, decode.json (both inputs merged) and
decode.md (measured figures only; docs/benchmarks.md shows them)."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from summarize import load, rows  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "results")
PLANS = ["fp16", "int4", "int2", "mixed"]


def flush_text(bench, sdpa_flush):
    how = {
        "read": "by reading a buffer 4x the L2 size, as FlashInfer's benchmarks do",
        "write": "by a memset, which leaves dirty lines for the timed kernel to write back",
    }
    mixkv = how.get(bench.get("l2_flush"), "by a memset (runs before the flush option)")
    if sdpa_flush and sdpa_flush != bench.get("l2_flush"):
        return f"mixkv and cuBLAS {mixkv}; SDPA {how.get(sdpa_flush, sdpa_flush)}"
    return mixkv


def main():
    bench, sdpa = load(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    sdpa_flush = None
    if len(sys.argv) > 2:
        with open(sys.argv[2]) as f:
            sdpa_flush = json.load(f).get("l2_flush")
    table = rows(bench, sdpa)
    bw = bench["read_bandwidth_gbps"]
    os.makedirs(DOCS, exist_ok=True)
    merged = dict(bench)
    merged["decode"] = table
    merged["sdpa_us"] = [{"batch": b, "context": c, "sdpa_us": t} for (b, c), t in sorted(sdpa.items())]
    with open(os.path.join(DOCS, "decode.json"), "w") as f:
        json.dump(merged, f, indent=1)

    contexts = sorted({r["context"] for r in table})
    batches = sorted({r["batch"] for r in table})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        width = 0.8 / (len(PLANS) + 2)
        for j, plan in enumerate(PLANS + ["dense_cublas_fp16"]):
            ys = []
            for b in batches:
                r = [x for x in table if x["batch"] == b and x["context"] == ctx and x["plan"] == plan]
                ys.append(r[0]["time_us"] if r else 0)
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=plan)
        ys = [sdpa.get((b, ctx), 0) for b in batches]
        ax.bar([i + (len(PLANS) + 1) * width for i in range(len(batches))], ys, width, label="torch SDPA")
        ax.set_xticks([i + 0.4 for i in range(len(batches))])
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode time per layer (us)")
        ax.set_title(f"context {ctx:,}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"mixkv paged decode, 28 q / 4 KV heads, D 128, block 32 ({bench['device']}, read BW {bw:.0f} GB/s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "decode.png"), dpi=110)

    lines = [
        "# GPU decode benchmark (measured)",
        "",
        f"Device: {bench['device']}, {bench['sms']} SMs. Read bandwidth of our own read-and-reduce kernel "
        f"over 4 GiB: **{bw:.0f} GB/s** (the ceiling used for %BW).",
        "Shape: 28 query heads, 4 KV heads, head_dim 128, block 32; one layer. L2 flushed before every "
        f"timed launch ({flush_text(bench, sdpa_flush)}); median of {bench['reps']} CUDA-event timings; "
        f"launch floor (a 4-byte memset timed the same way) {bench.get('launch_floor_us', float('nan')):.1f} us. "
        "Bytes = what the kernels must read "
        "(codes, parameters, FP16 rows, page-table entries, queries). `dense` = cuBLAS FP16 GEMM + softmax "
        "+ GEMM on contiguous K/V of the same tokens; SDPA = torch "
        "`scaled_dot_product_attention(enable_gqa=True)` timed the same way (benchmarks/sdpa_bench.py).",
        "Produced by `benchmarks/run_on_device.sh` and `benchmarks/plot_decode.py`; raw data in decode.json.",
        "",
        "![decode](decode.png)",
        "",
        "| batch | context | plan | time (us) | MB read | GB/s | % of read BW | x dense cuBLAS | x SDPA |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(table, key=lambda r: (r["context"], r["batch"], r["plan"])):
        s = f"{r['ratio_sdpa']:.3f}" if r["ratio_sdpa"] is not None else "-"
        lines.append(
            f"| {r['batch']} | {r['context']:,} | {r['plan']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
            f"{r['gbps']:.0f} | {r['pct_bw']:.1f}% | {r['ratio_dense']:.3f} | {s} |"
        )
    lines += [
        "",
        "SDPA times (us): " + ", ".join(f"batch {b} x {c:,}: {t:.1f}" for (b, c), t in sorted(sdpa.items())),
        "",
        "## store_prefill (one sequence, one layer)",
        "",
        "A plain read of as many bytes (our read-and-reduce kernel, timed the same way, L2 flushed) is the",
        "rate a transfer of that size reaches at all: the last column is the store's time against it.",
        "",
        "| context | plan | time (us) | MB moved (read + written) | GB/s | % of read BW | read of the same bytes (us) | store at % of that read's rate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in bench.get("store_prefill", []):
        read_us = r.get("read_same_bytes_us")
        read_cells = f"{read_us:.1f} | {100.0 * read_us / r['time_us']:.0f}%" if read_us else "- | -"
        lines.append(
            f"| {r['context']:,} | {r['plan']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
            f"{r['gbps']:.0f} | {r['pct_bw']:.1f}% | {read_cells} |"
        )
    with open(os.path.join(DOCS, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", os.path.join(DOCS, "decode.png"), "decode.json", "decode.md")


if __name__ == "__main__":
    main()
