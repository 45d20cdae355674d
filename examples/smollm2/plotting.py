"""The figure of docs/real-model.md: perplexity against prompt KV bytes for
every decoded variant and every chunk-scored plan, and the question sets'
pooled perplexity against FP16."""

from __future__ import annotations

import numpy as np
from planning import EQ8_MEASURED, ERROR_FLOORS, QA_MEASURED, TARGET_ERROR_FLOORS

# One color per decode variant, in both panels of the plot.
VARIANT_COLORS = {
    "FP16": "black",
    "WindowQuant": "tab:blue",
    "WindowQuant, INT4 floor": "tab:green",
    QA_MEASURED: "tab:brown",
    EQ8_MEASURED: "tab:cyan",
    ERROR_FLOORS: "darkgreen",
    TARGET_ERROR_FLOORS: "olivedrab",
    "INT4": "tab:orange",
    "INT2": "tab:red",
}


def plot(r, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = r.get("question_sets", [])
    fig, axes = plt.subplots(2 if sets else 1, 1, figsize=(12.0, 10.4 if sets else 5.6), dpi=120, squeeze=False)
    ax = axes[0][0]
    base = r["rows"][0]["ppl"]
    sweep = r.get("sweep", [])
    pts = sorted(
        (s["bytes_ratio"], s["ppl"])
        for s in sweep
        if s["name"].startswith("WindowQuant alpha") and "," not in s["name"]
    )
    if pts:
        ax.plot(
            *zip(*pts),
            "o--",
            color="tab:blue",
            alpha=0.45,
            ms=5,
            label="WindowQuant, alpha 2 / 8 / 32 / 300 (chunk-scored)",
        )
    diag = [s for s in sweep if s["name"].startswith("diagnose: INT2 in layers")]
    if diag:
        ax.plot(
            [s["bytes_ratio"] for s in diag],
            [s["ppl"] for s in diag],
            "x",
            color="tab:purple",
            ms=6,
            label="INT2 in 5 layers, INT4 elsewhere (chunk-scored)",
        )
    series = [
        ("query-aware x eq. 9 s_l", "v--", "tab:gray", "query-aware scores x eq. 9 s_l, alpha 2 / 32"),
        ("query-aware x measured s_l", "D-", "tab:brown", "query-aware scores x measured s_l, alpha 8 / 32"),
        (
            "diagnose: attention mass x measured s_l",
            "^:",
            "tab:olive",
            "attention mass x measured s_l, alpha 2 / 8 / 32",
        ),
        ("WindowQuant (eq. 8) x measured s_l", "o-", "tab:cyan", "eq. 8 scores x measured s_l, alpha 2 / 8 / 32"),
        (
            "diagnose: eq. 8 x prompt-measured s_l",
            "P:",
            "tab:pink",
            "eq. 8 scores x s_l measured on the prompt, alpha 8 / 32",
        ),
        ("INT4 floor on the", "*-", "tab:green", "INT4 floors on the 1-10 layers of largest question error"),
        (
            "diagnose: INT4 floor on the",
            "*:",
            "darkseagreen",
            "INT4 floors on the 1-10 layers of largest calibration KL",
        ),
    ]
    for prefix, style, color, label in series:
        pts = sorted(
            (s["bytes_ratio"], s["ppl"]) for s in sweep if s["name"].startswith(prefix) and "prompt KL" not in s["name"]
        )
        if pts:
            ax.plot(*zip(*pts), style, color=color, alpha=0.6, ms=5, label=f"{label} (chunk-scored)")
    for row in r["rows"]:
        ax.plot(
            row["bytes_ratio"],
            row["ppl"],
            "s",
            ms=8,
            color=VARIANT_COLORS.get(row["variant"], "gray"),
            label=f"{row['variant']} (decoded through mixkv)",
        )
    ax.axhline(base * 1.03, color="gray", ls=":", lw=1, label="FP16 perplexity + 3%")
    ax.axvline(0.35, color="gray", ls="-.", lw=0.8, label="0.35x FP16 bytes")
    ax.set_xlabel("prompt KV bytes / all-FP16 KV bytes")
    ax.set_ylabel("perplexity of the held-out answer")
    ax.set_title(
        f"SmolLM2-135M-Instruct, {r['document_tokens']}-token document, mixkv {r['backend'].upper()} backend",
        fontsize=9,
    )
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the points
    ax.grid(alpha=0.3)
    if sets:
        plot_question_sets(axes[1][0], sets)
    fig.tight_layout()
    fig.savefig(path)


def mean_bytes_ratio(question_set, plan: str) -> float:
    return float(np.mean([q["plans"][plan]["bytes_ratio"] for q in question_set["questions"]]))


def plot_question_sets(ax, sets):
    """Pooled perplexity against FP16 per question set: the floors by
    question error at every budget as a line, the other plans as points."""
    markers = {"held-out": "o", "test": "s", "confirmation": "D"}
    points = ("WindowQuant", "WindowQuant, INT4 floor", EQ8_MEASURED, "INT4", "INT2")  # the floors are the line
    for qs in sets:
        marker = markers.get(qs["name"], "^")
        tokens = sum(q["answer_tokens"] - 1 for q in qs["questions"])
        floors = sorted(
            (mean_bytes_ratio(qs, plan), 100 * v)
            for plan, v in qs["pooled_vs_fp16"].items()
            if plan.startswith("WindowQuant, INT4 floor where")
        )
        ax.plot(
            *zip(*floors),
            marker + "-",
            color="darkgreen",
            alpha=0.75,
            ms=6,
            label=f"{qs['name']} set ({len(qs['questions'])} questions, {tokens} tokens): INT4 floors by "
            "question error, budgets 0.225-0.325x",
        )
        for plan in points:
            ax.plot(
                mean_bytes_ratio(qs, plan),
                100 * qs["pooled_vs_fp16"][plan],
                marker,
                color=VARIANT_COLORS[plan],
                ms=6,
                alpha=0.75,
                label=f"{qs['name']} set: {plan}",
            )
    ax.axhline(3.0, color="gray", ls=":", lw=1, label="+3%")
    ax.axvline(0.35, color="gray", ls="-.", lw=0.8, label="0.35x FP16 bytes")
    ax.set_yscale("symlog", linthresh=10.0)  # linear around FP16, compressed up to uniform INT2
    ticks = [-10, -5, 0, 3, 5, 10, 20, 50, 100]
    ax.set_yticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
    ax.set_ylim(-12, 140)
    ax.set_xlabel("prompt KV bytes / all-FP16 KV bytes")
    ax.set_ylabel("pooled perplexity vs FP16 (%)")
    ax.set_title("question sets (chunk-scored, each answer scored after its own question)", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
