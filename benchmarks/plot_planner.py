"""Plots runs of gpu_planner_bench (the JSON each writes), run here on the
fetched files:
    python3 benchmarks/plot_planner.py OUT.png RUN.json [RUN.json ...]
Per element type and run: the planner's median time launched onto an idle
stream, replayed there as a CUDA graph, and queued behind a busy stream,
beside a plain read of the same bytes timed from an idle stream and queued,
against the 0.05 ms target."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [  # (JSON key, label, color, hatch)
    ("gpu_median_ms", "planner, idle stream (host submission included)", "tab:blue", ""),
    ("graph_gpu_median_ms", "planner as a CUDA graph, idle stream", "tab:purple", ""),
    ("queued_gpu_median_ms", "planner, queued behind work (device time)", "tab:green", ""),
    ("plain_read_median_ms", "plain read of the same bytes, idle stream", "tab:gray", "//"),
    ("queued_plain_read_median_ms", "plain read, queued", "silver", "//"),
]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, paths = sys.argv[1], sys.argv[2:]
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    types = [r["type"] for r in runs[0]["results"]]
    fig, ax = plt.subplots(figsize=(10.0, 4.8), dpi=120)
    group = len(runs) * len(SERIES) + 1  # bars per element type, with a gap
    for t, type_name in enumerate(types):
        for k, run in enumerate(runs):
            result = next(r for r in run["results"] if r["type"] == type_name)
            for s, (key, label, color, hatch) in enumerate(SERIES):
                if key not in result:  # runs before the graph timing existed
                    continue
                x = t * group + s * len(runs) + k
                ax.bar(
                    x,
                    1e3 * result[key],
                    color=color,
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.4,
                    label=label if t == 0 and k == 0 else None,
                )
    ax.axhline(1e3 * runs[0]["target_ms"], color="red", ls="--", lw=1, label="target 0.05 ms")
    ax.set_xticks([t * group + (group - 1) / 2 - 0.5 for t in range(len(types))])
    ax.set_xticklabels([f"{name} embeddings" for name in types])
    ax.set_ylabel("median of 100 launches (us)")
    ax.set_title(
        f"WindowQuant GPU planner, {runs[0]['frames']} frames x {runs[0]['tokens_per_frame']} tokens, "
        f"hidden {runs[0]['hidden']}, {runs[0]['device']}: {len(runs)} runs side by side",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
