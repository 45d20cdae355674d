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
    for name, b in rows.items():
        if "label" not in b:
            continue
        shape, plan = b["label"].rsplit(" ", 1) if not b["label"].endswith("dense fp32") else (
            b["label"][: -len(" dense fp32")], "dense fp32")
        table.append({"shape": shape, "plan": plan, "ms": b["real_time"], "bytes": b["bytes"],
                      "gbps": b["bytes/s"] / 1e9, "pct_read_bw": 100.0 * b["bytes/s"] / read_bw})
    dense = {r["shape"]: r["ms"] for r in table if r["plan"] == "dense fp32"}
    for r in table:
        r["x_dense"] = r["ms"] / dense[r["shape"]]
    shapes = sorted({r["shape"] for r in table})
    os.makedirs(DOCS, exist_ok=True)
    shutil.copyfile(sys.argv[1], os.path.join(DOCS, "cpu_decode.json"))

    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        ys = [next((r["ms"] for r in table if r["shape"] == shape and r["plan"] == p), 0) for p in PLANS]
        ax.bar(PLANS, ys, color=["C0", "C1", "C2", "C3", "C7"])
        ax.set_title(shape)
        ax.set_ylabel("one decode call, one layer (ms)")
    ctx = run["context"]
    fig.suptitle(f"mixkv CPU decode attention, 1 thread ({ctx.get('host_name', '')}, "
                 f"{ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz)")
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "cpu_decode.png"), dpi=110)

    lines = ["# CPU decode attention (measured)", "",
             "`cpu::decode_attention` (the CPU backend: the double-precision reference, and the decode of the",
             "demo on machines without a GPU), one layer of one sequence, one thread, block 32. Shapes: SmolLM2-135M",
             "(9 query / 3 KV heads x 64, 3,072 tokens) and Qwen2-7B (28 / 4 x 128, 4,096 tokens). Plans: all-FP16,",
             "all-INT4, all-INT2 and 10% FP16 / 30% INT4 / 60% INT2. Side by side in the same run: a dense float32",
             "attention over contiguous K/V of the same tokens, and one thread's read bandwidth (a sum over",
             f"256 MiB: {read_bw / 1e9:.1f} GB/s). Medians of the run's repetitions; bytes = what the call must",
             "read (codes, parameters, FP16 rows).",
             "Produced by `benchmarks/cpu_decode_bench` and `benchmarks/plot_cpu_decode.py`; raw data in",
             "cpu_decode.json.", "", "![cpu decode](cpu_decode.png)", "",
             "| shape | plan | time (ms) | MB read | GB/s | % of 1-thread read BW | x dense fp32 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for shape in shapes:
        for p in PLANS:
            r = next((r for r in table if r["shape"] == shape and r["plan"] == p), None)
            if r:
                lines.append(f"| {shape} | {p} | {r['ms']:.2f} | {r['bytes'] / 1e6:.2f} | {r['gbps']:.2f} | "
                             f"{r['pct_read_bw']:.1f}% | {r['x_dense']:.2f} |")
    with open(os.path.join(DOCS, "cpu-decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", os.path.join(DOCS, "cpu_decode.png"), "cpu_decode.json", "cpu-decode.md")


if __name__ == "__main__":
    main()
