"""Plots and tabulates a run of cpu_decode_bench (Google Benchmark JSON):
    build/benchmarks/cpu_decode_bench --benchmark_repetitions=5 \
        --benchmark_report_aggregates_only=true \
        --benchmark_out=cpu_decode.json --benchmark_out_format=json
    python3 benchmarks/plot_cpu_decode.py cpu_decode.json
writes benchmarks/results/cpu_decode.{json,png} and cpu-decode.md (medians)."""

import json
import os
import shutil
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "results")
PLANS = ["fp16", "int4", "int2", "mixed", "dense fp32"]


def medians(run):
    out = {}
    for b in run["benchmarks"]:
        if b.get("aggregate_name", "median") != "median":
            continue
        out[b["run_name"]] = b
    return out


def main():
    with open(sys.argv[1]) as f:
        run = json.load(f)
    rows = medians(run)
    read_bw = next(b["bytes/s"] for name, b in rows.items() if name.startswith("BM_ReadBandwidth"))
    table = []
    for b in rows.values():
        if "label" not in b:
            continue
        shape, plan, threads = b["label"].split("|")
        table.append(
            {
                "shape": shape,
                "plan": plan,
                "threads": int(threads),
                "ms": b["real_time"],
                "bytes": b["bytes"],
                "gbps": b["bytes/s"] / 1e9,
                "pct_read_bw": 100.0 * b["bytes/s"] / read_bw,
            }
        )
    dense = {r["shape"]: r["ms"] for r in table if r["plan"] == "dense fp32"}
    for r in table:
        r["x_dense"] = r["ms"] / dense[r["shape"]]
    shapes = list(dict.fromkeys(r["shape"] for r in table))
    os.makedirs(DOCS, exist_ok=True)
    shutil.copyfile(sys.argv[1], os.path.join(DOCS, "cpu_decode.json"))

    def find(shape, plan, threads):
        return next((r for r in table if (r["shape"], r["plan"], r["threads"]) == (shape, plan, threads)), None)

    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for i, threads in enumerate((1, 2)):
            ys = [(find(shape, p, threads) or find(shape, p, 1) or {"ms": 0})["ms"] for p in PLANS]
            xs = [j + (i - 0.5) * 0.4 for j in range(len(PLANS))]
            ax.bar(xs, ys, 0.4, label=f"{threads} thread{'s' if threads > 1 else ''} (dense: 1)")
        ax.set_xticks(range(len(PLANS)), PLANS)
        ax.set_title(shape, fontsize=9)
        ax.set_ylabel("one decode call, one layer (ms)")
    axes[0][0].legend(fontsize=8)
    ctx = run["context"]
    fig.suptitle(
        f"mixkv CPU decode attention ({ctx.get('host_name', '')}, "
        f"{ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, load {ctx.get('load_avg')})"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "cpu_decode.png"), dpi=110)

    load = " / ".join(f"{x:.2f}" for x in ctx.get("load_avg", []))
    lines = [
        "# CPU decode attention (measured)",
        "",
        "`cpu::decode_attention` (the CPU backend: the reference for the CUDA kernels, and the decode of",
        "engines without a GPU), one layer, block 32, 1 and 2 threads. Shapes: SmolLM2-135M (9 query / 3 KV",
        "heads x 64, one sequence of 3,072 tokens), Qwen2-7B (28 / 4 x 128, one of 4,096) and Llama-3-8B",
        "(32 / 8 x 128, a batch of 8 x 2,048). Plans: all-FP16, all-INT4, all-INT2 and 10% FP16 / 30% INT4 /",
        "60% INT2. Side by side in the same run: a dense float32 attention over contiguous K/V of the same",
        "tokens (one thread), and one thread's read bandwidth (a sum over 256 MiB:",
        f"{read_bw / 1e9:.1f} GB/s). Medians of the run's repetitions; bytes = what the call must read (codes,",
        f"parameters, FP16 rows). Load average during the run: {load}.",
        "Produced by `benchmarks/cpu_decode_bench` and `benchmarks/plot_cpu_decode.py`; raw data in",
        "cpu_decode.json. Against NumPy: cpu_decode_vs_numpy.md.",
        "",
        "![cpu decode](cpu_decode.png)",
        "",
        "| shape | plan | threads | time (ms) | MB read | GB/s | % of 1-thread read BW | x dense fp32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in shapes:
        for p in PLANS:
            for threads in (1, 2):
                r = find(shape, p, threads)
                if r:
                    lines.append(
                        f"| {shape} | {p} | {threads} | {r['ms']:.2f} | {r['bytes'] / 1e6:.2f} | "
                        f"{r['gbps']:.2f} | {r['pct_read_bw']:.1f}% | {r['x_dense']:.2f} |"
                    )
    with open(os.path.join(DOCS, "cpu-decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(shapes) * 9 - 2 :]))
    print("wrote", os.path.join(DOCS, "cpu_decode.png"), "cpu_decode.json", "cpu-decode.md")


if __name__ == "__main__":
    main()
