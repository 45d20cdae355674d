"""Plots benchmarks/results/prefix_engine.json (prefix_engine_bench.py) as
benchmarks/results/prefix_engine.png: for every run of the engine loop, the
prefill rows served from the cache, time to first token (p50 and p99),
output tokens per second and cached videos held per GiB.

    python3 benchmarks/plot_prefix_engine.py [in.json] [out.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "prefix_engine.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results" / "prefix_engine.png"
    doc = json.loads(src.read_text())
    runs = doc["runs"]
    names = [r["name"] for r in runs]
    y = list(range(len(runs)))
    fig, axes = plt.subplots(1, 4, figsize=(20, 3.2 + 0.5 * len(runs)))

    def bars(ax, values, label, line=None):
        ax.barh(y, values, color="tab:blue")
        if line is not None:
            ax.axvline(line, color="k", ls="--", lw=1)
        ax.set_yticks(y, names if ax is axes[0] else [""] * len(y), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label)

    bars(axes[0], [100 * r["cache_share"] for r in runs], "prefill rows served from the cache (%)", 80)
    ax = axes[1]
    ax.barh([i - 0.2 for i in y], [r["ttft_ms_p50"] for r in runs], height=0.4, color="tab:blue", label="p50")
    ax.barh(
        [i + 0.2 for i in y], [r["ttft_ms_p99"] for r in runs], height=0.4, color="tab:blue", alpha=0.45, label="p99"
    )
    ax.set_yticks(y, [""] * len(y))
    ax.invert_yaxis()
    ax.set_xlabel("time to first token (ms; light: p99)")
    ax.legend(fontsize=8)
    bars(axes[2], [r["output_tok_s"] for r in runs], "output tokens / s")
    held = [r["videos_per_gib"] or 0.0 for r in runs]
    fp16 = [r["videos_per_gib"] for r in runs if r["run"] == "fp16-prefix" and r["videos_per_gib"]]
    bars(axes[3], held, "videos held / GiB of cached blocks", 3 * fp16[0] if fp16 else None)
    meta = doc["meta"]
    fig.suptitle(
        f"prefix caching in the engine loop: {meta['model']}, {meta['trace']['requests']} requests on "
        f"{meta['trace']['videos_asked']} videos of {meta['trace']['video_rows']} rows ({meta['device']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
