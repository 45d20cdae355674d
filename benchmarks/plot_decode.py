"""Plots and tabulates a device run of decode_bench (+ sdpa_bench, + FlashInfer's
paged decode), run here on the fetched JSON:
    python3 benchmarks/plot_decode.py RUN/decode_bench.json RUN/sdpa_bench.json \
        [RUN/flashinfer_decode_bench.json]
(or RUN/decode.json alone, summarize.py's merge of the three) writes
benchmarks/results/decode.png, decode.json (the inputs merged) and decode.md
(measured figures only; docs/benchmarks.md shows them)."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from summarize import load, merged, rows  # noqa: E402

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


def fi_text(fi_run):
    if fi_run is None:
        return "FlashInfer: not in this run."
    if fi_run.get("skipped"):
        return f"FlashInfer: skipped in this run ({fi_run['skipped']})."
    return (
        f"FlashInfer {fi_run.get('flashinfer', '?')} = `BatchDecodeWithPagedKVCacheWrapper` (use_tensor_cores=True, "
        "fa2, pages of 32, HND, page ids shuffled), FP16 K/V and FP8 e4m3 K/V with per-tensor k_scale/v_scale "
        "(its out *= v_scale launch timed with it), timed in the same device run the same way "
        "(benchmarks/flashinfer_decode_bench.py); its ratio columns divide mixkv's time by FlashInfer's."
    )


def main():
    sdpa_path = sys.argv[2] if len(sys.argv) > 2 else None
    fi_path = sys.argv[3] if len(sys.argv) > 3 else None
    bench, sdpa, fi, fi_run = load(sys.argv[1], sdpa_path, fi_path)
    sdpa_flush = bench.get("sdpa_l2_flush")
    if sdpa_path:
        with open(sdpa_path) as f:
            sdpa_flush = json.load(f).get("l2_flush")
    table = rows(bench, sdpa, fi)
    bw = bench["read_bandwidth_gbps"]
    os.makedirs(DOCS, exist_ok=True)
    out = merged(bench, sdpa, fi, fi_run)
    out["sdpa_l2_flush"] = sdpa_flush
    with open(os.path.join(DOCS, "decode.json"), "w") as f:
        json.dump(out, f, indent=1)
    fi_variants = [v for v in ("fp16", "fp8") if any(k[2] == v for k in fi)]

    contexts = sorted({r["context"] for r in table})
    batches = sorted({r["batch"] for r in table})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        width = 0.8 / (len(PLANS) + 2 + len(fi_variants))
        for j, plan in enumerate(PLANS + ["dense_cublas_fp16"]):
            ys = []
            for b in batches:
                r = [x for x in table if x["batch"] == b and x["context"] == ctx and x["plan"] == plan]
                ys.append(r[0]["time_us"] if r else 0)
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=plan)
        ys = [sdpa.get((b, ctx), 0) for b in batches]
        ax.bar([i + (len(PLANS) + 1) * width for i in range(len(batches))], ys, width, label="torch SDPA")
        for j, v in enumerate(fi_variants):
            ys = [fi[(b, ctx, v)]["time_us"] if (b, ctx, v) in fi else 0 for b in batches]
            xs = [i + (len(PLANS) + 2 + j) * width for i in range(len(batches))]
            ax.bar(xs, ys, width, label=f"FlashInfer {v.upper()} KV")
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
        fi_text(fi_run),
        "Produced by `benchmarks/run_on_device.sh` and `benchmarks/plot_decode.py`; raw data in decode.json.",
        "",
        "![decode](decode.png)",
        "",
        "| batch | context | plan | time (us) | MB read | GB/s | % of read BW | x dense cuBLAS | x SDPA "
        "| x FlashInfer FP16 | x FlashInfer FP8 |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(x):
        return f"{x:.3f}" if x is not None else "-"

    for r in sorted(table, key=lambda r: (r["context"], r["batch"], r["plan"])):
        lines.append(
            f"| {r['batch']} | {r['context']:,} | {r['plan']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | "
            f"{r['gbps']:.0f} | {r['pct_bw']:.1f}% | {r['ratio_dense']:.3f} | {cell(r['ratio_sdpa'])} | "
            f"{cell(r['ratio_flashinfer_fp16'])} | {cell(r['ratio_flashinfer_fp8'])} |"
        )
    lines += [
        "",
        "SDPA times (us): " + ", ".join(f"batch {b} x {c:,}: {t:.1f}" for (b, c), t in sorted(sdpa.items())),
    ]
    if fi:
        lines += [
            "",
            "FlashInfer paged decode times (us): "
            + ", ".join(f"{v} batch {b} x {c:,}: {e['time_us']:.1f}" for (b, c, v), e in sorted(fi.items())),
        ]
    inv = bench.get("batch_invariant", [])
    if inv:
        lines += [
            "",
            "## Batch-invariant decode (DecodePlanConfig::batch_invariant_blocks)",
            "",
            "Each (sequence, KV head) cut into chunks of B blocks by its own page lists alone, timed in the same "
            "run right after the automatic plan on the same tables; `x auto` is the time against it.",
            "",
            "| batch | context | plan | B (blocks) | time (us) | x auto | items | automatic plan's items |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(inv, key=lambda r: (r["context"], r["batch"], r["plan"], r["batch_invariant_blocks"])):
            lines.append(
                f"| {r['batch']} | {r['context']:,} | {r['plan']} | {r['batch_invariant_blocks']} | "
                f"{r['time_us']:.1f} | {r['ratio_auto']:.3f} | {r['items']} | {r['auto_items']} |"
            )
        split16 = {(k[0], k[1]): e for k, e in fi.items() if k[2] == "fp16_split16"}
        fi16 = {(k[0], k[1]): e for k, e in fi.items() if k[2] == "fp16"}
        if split16:
            lines += [
                "",
                "FlashInfer's own batch-invariant control (fixed_split_size = 16 pages) against its default split, "
                "same run: "
                + ", ".join(
                    f"batch {b} x {c:,}: {e['time_us']:.1f} us = {e['time_us'] / fi16[(b, c)]['time_us']:.3f}x"
                    for (b, c), e in sorted(split16.items())
                    if (b, c) in fi16
                ),
            ]
    lines += [
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
