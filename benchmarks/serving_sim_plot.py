"""Plots benchmarks/results/serving-sim.json (benchmarks/serving_sim) into
benchmarks/results/serving-sim.png."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/serving-sim.json"
dst = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/results/serving-sim.png"
data = json.load(open(src))
fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
for run in data["runs"]:
    axes[0].plot(run["running"], label=run["plan"], linewidth=1)
    axes[1].plot(run["preemptions_cumulative"], label=run["plan"], linewidth=1)
    axes[2].plot(run["decode_tokens"], label=run["plan"], linewidth=1)
axes[0].set_ylabel("concurrent requests")
axes[1].set_ylabel("preemptions (cumulative)")
axes[2].set_ylabel("decode tokens / step")
axes[2].set_xlabel("engine step")
axes[0].legend()
fig.suptitle(
    f"{data['requests']} 100-frame video-QA requests, {data['arrivals_per_step']:.0f} arrivals/step, "
    f"{data['arena_gb']} GB KV arena (Qwen2-7B shapes)"
)
fig.tight_layout()
fig.savefig(dst, dpi=110)
