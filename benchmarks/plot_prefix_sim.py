"""Plots benchmarks/results/prefix_sim.json (mixkv_prefix_sim) as
benchmarks/results/prefix_sim.png: prefill served from the cache, time to
first token, cached videos held per GiB and output tokens per modelled
second for every run, and, when the JSON has it (--sweep), the video trace's
precision-aware runs against rho, the score correlation between questions.

    python3 benchmarks/plot_prefix_sim.py [in.json] [out.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "prefix_sim.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results" / "prefix_sim.png"
    doc = json.loads(src.read_text())
    runs = [(t["name"], r) for t in doc["traces"] for r in t["runs"]]
    labels = [f"{trace}: {r['variant']}" for trace, r in runs]
    colors = ["tab:blue" if trace.startswith("video") else "tab:orange" for trace, _ in runs]
    sweep = doc.get("rho_sweep", [])

    panels = 5 if sweep else 4
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 6.2))
    y = list(range(len(runs)))

    ax = axes[0]
    ax.barh(y, [100 * r["served_from_cache"] for _, r in runs], color=colors)
    ax.axvline(80, color="k", ls="--", lw=1)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("prefill rows served from the cache (%)")
    ax.set_title("prefill served from cache (target 80%)")

    ax = axes[1]
    ax.barh([i - 0.2 for i in y], [r["ttft_steps_p50"] for _, r in runs], height=0.4, color=colors, label="p50")
    ax.barh(
        [i + 0.2 for i in y], [r["ttft_steps_p99"] for _, r in runs], height=0.4, color=colors, alpha=0.45, label="p99"
    )
    ax.set_xscale("log")
    ax.set_yticks(y, [""] * len(y))
    ax.invert_yaxis()
    ax.set_xlabel("time to first token (engine steps; light: p99)")
    ax.set_title("TTFT")

    ax = axes[2]
    vid = [(label, r) for label, (trace, r) in zip(labels, runs) if trace.startswith("video") and r["prefix_cache"]]
    yv = list(range(len(vid)))
    ax.barh(yv, [r["videos_per_gib_end"] for _, r in vid], color="tab:blue")
    fp16 = [r["videos_per_gib_end"] for _, r in vid if r["plans"] == "FP16"]
    if fp16:
        ax.axvline(3 * fp16[0], color="k", ls="--", lw=1, label="3x FP16-only")
        ax.legend(fontsize=8)
    ax.set_yticks(yv, [label.split(": ", 1)[1] for label, _ in vid], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("videos held / GiB of cached blocks (end of run)")
    ax.set_title("cached prefixes per GiB (video QA)")

    ax = axes[3]
    ax.barh(y, [r["output_tokens_per_s"] for _, r in runs], color=colors)
    ax.set_yticks(y, [""] * len(y))
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / modelled GPU-second")
    ax.set_title("throughput (roofline step model)")

    if sweep:
        ax = axes[4]
        ax2 = ax.twinx()
        for higher, style in ((True, "o-"), (False, "s--")):
            pts = sorted((p["rho"], p) for p in sweep if p["share_higher"] == higher)
            name = "share_higher" if higher else "exact only"
            ax.plot(
                [r for r, _ in pts],
                [100 * p["served_from_cache"] for _, p in pts],
                style,
                color="tab:blue",
                label=f"% from cache, {name}",
            )
            ax2.plot(
                [r for r, _ in pts],
                [p["videos_per_gib_end"] for _, p in pts],
                style,
                color="tab:green",
                label=f"videos/GiB, {name}",
            )
        ax.set_xlabel("rho: score correlation between two questions about one video")
        ax.set_ylabel("% prefill from cache", color="tab:blue")
        ax2.set_ylabel("videos held / GiB", color="tab:green")
        ax.legend(fontsize=7, loc="upper left")
        ax2.legend(fontsize=7, loc="center left")
        ax.set_title("WindowQuant plans vs question agreement")

    fig.suptitle(
        "Prefix caching in the serving simulation (Qwen2-7B shapes, 126 GB arena; blue: video QA, "
        "orange: shared system prompt)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
