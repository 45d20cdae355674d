"""Tabulates and plots a device run of `run_on_device.sh --shapes` (mixkv and
torch SDPA on other models' head shapes), run here on the fetched folder:
    python3 benchmarks/plot_shapes.py RUN/shapes
writes benchmarks/results/shapes.md (measured figures only), shapes.json (the
inputs merged) and shapes.png."""

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "results")
PLANS = ["fp16", "int4", "int2", "mixed"]


def load(folder):
    shapes = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        if path.endswith("_sdpa.json"):
            continue
        name = os.path.basename(path)[: -len(".json")]
        with open(path) as f:
            bench = json.load(f)
        sdpa_path = os.path.join(folder, name + "_sdpa.json")
        sdpa = {}
        if os.path.exists(sdpa_path):
            with open(sdpa_path) as f:
                sdpa = {(r["batch"], r["context"]): r["sdpa_us"] for r in json.load(f)["sdpa"]}
        shapes.append({"name": name, "bench": bench, "sdpa": sdpa})
    return shapes


def main():
    shapes = load(sys.argv[1])
    if not shapes:
        sys.exit(f"no shape results under {sys.argv[1]}")
    os.makedirs(DOCS, exist_ok=True)
    lines = [
        "# Decode on other models' head shapes",
        "",
        "Produced by `benchmarks/plot_shapes.py` from a `benchmarks/run_on_device.sh --shapes` run: one layer, "
        "block 32, 19,600 tokens a sequence, the plans of the main benchmark (docs/benchmarks.md), L2 flushed before every "
        "timed launch, median of 30 CUDA-event timings; SDPA is torch's `scaled_dot_product_attention` "
        "(enable_gqa) on dense FP16 K/V of the same tokens, timed the same way. %BW: bytes the plan reads over "
        "the time, against the machine's own read bandwidth. Heads are one GPU's (no tensor parallelism). "
        "What limits each shape: docs/kernels.md.",
        "",
        "| shape | q / KV heads | head_dim | batch | plan | us | %BW | x SDPA | items |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    merged = []
    for s in shapes:
        b = s["bench"]
        shape = b["shape"]
        for r in b["decode"]:
            if r["plan"] not in PLANS:
                continue
            sdpa = s["sdpa"].get((r["batch"], r["context"]))
            ratio = f"{r['time_us'] / sdpa:.3f}" if sdpa else "-"
            lines.append(
                f"| {s['name']} | {shape['q_heads']} / {shape['kv_heads']} | {shape['head_dim']} | {r['batch']} | "
                f"{r['plan']} | {r['time_us']:.1f} | {r['pct_bw']:.1f} | {ratio} | {r['items']} |"
            )
        merged.append(
            {
                "name": s["name"],
                "bench": b,
                "sdpa_us": [{"batch": k[0], "context": k[1], "sdpa_us": v} for k, v in sorted(s["sdpa"].items())],
            }
        )
    bws = sorted({s["bench"]["read_bandwidth_gbps"] for s in shapes})
    lines += [
        "",
        f"Read bandwidth measured in each shape's run: {', '.join(f'{x:,.0f}' for x in bws)} GB/s "
        f"({shapes[0]['bench']['device']}).",
        "",
        "![time against SDPA](shapes.png)",
        "",
    ]
    with open(os.path.join(DOCS, "shapes.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(DOCS, "shapes.json"), "w") as f:
        json.dump(merged, f, indent=1)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(PLANS)
    for ax, batch in zip(axes, (1, 64)):
        for i, plan in enumerate(PLANS):
            xs, ys = [], []
            for k, s in enumerate(shapes):
                for r in s["bench"]["decode"]:
                    sdpa = s["sdpa"].get((r["batch"], r["context"]))
                    if r["plan"] == plan and r["batch"] == batch and sdpa:
                        xs.append(k + (i - 1.5) * width)
                        ys.append(r["time_us"] / sdpa)
            ax.bar(xs, ys, width, label=plan)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([s["name"] for s in shapes], rotation=20, fontsize=8)
        ax.set_ylabel("time / SDPA time")
        ax.set_title(f"batch {batch} x 19,600 tokens")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "shapes.png"), dpi=110)


if __name__ == "__main__":
    main()
