"""Plot and report of benchmarks/serving_bench.py's JSON: tokens/s against
the KV budget per plan (decode-only steps and end to end), a markdown table,
quality, and the issue's targets (met or missed).

  python benchmarks/plot_serving.py serving.json [--png serving.png] [--md serving.md]
"""

from __future__ import annotations

import argparse
import json
import sys

TARGETS = (
    # (name, numerator plan, denominator plan, minimum ratio of decode tokens/s)
    ("WindowQuant >= 3x the FP16 plan", "windowquant", "fp16", 3.0),
    ("WindowQuant >= 1.5x FlashInfer FP8", "windowquant", "flashinfer-fp8", 1.5),
    ("mixkv FP16 within 3% of FlashInfer FP16", "fp16", "flashinfer-fp16", 0.97),
)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(result) -> list[str]:
    lines = [
        "| budget | plan | requests | output tok/s | decode tok/s | decode step p50 / p99 (ms) | of it step() p50 "
        "(ms) | decode batch max (mean) | KV peak (GiB) | preemptions |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['budget_gib']:g} GiB | {r['name']} | {r['error']} |||||||")
            continue
        cut = "" if r["complete"] else " (cut short)"
        lines.append(
            f"| {r['budget_gib']:g} GiB | {r['name']} | {r['requests']}{cut} | {_fmt(r['output_tok_s'], ',.0f')} | "
            f"{_fmt(r['decode_tok_s'], ',.0f')} | {_fmt(r['decode_step_ms_p50'], '.2f')} / "
            f"{_fmt(r['decode_step_ms_p99'], '.2f')} | {_fmt(r.get('decode_schedule_ms_p50'), '.2f')} | "
            f"{r['decode_batch_max']} ({r['decode_batch_mean']:.0f}) | "
            f"{r['kv_bytes_peak'] / 2**30:.2f} | {r.get('preemptions', 0)} |"
        )
    return lines


def targets(result) -> list[str]:
    runs = {(r["budget_gib"], r["plan"]): r for r in result["runs"] if "error" not in r}
    budgets = sorted({b for b, _ in runs})
    lines = ["| target | " + " | ".join(f"{b:g} GiB" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
    for name, num, den, want in TARGETS:
        cells = []
        for b in budgets:
            a, c = runs.get((b, num)), runs.get((b, den))
            if not a or not c or not a.get("decode_tok_s") or not c.get("decode_tok_s"):
                cells.append("-")
                continue
            ratio = a["decode_tok_s"] / c["decode_tok_s"]
            cells.append(f"{ratio:.2f}x {'met' if ratio >= want else '**missed**'}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def quality_lines(result) -> list[str]:
    q = result.get("quality", {})
    names = result["meta"].get("plans", {})
    lines = []
    for key, g in q.get("greedy", {}).items():
        lines.append(
            f"- {names.get(key, key)} greedy tokens vs the dense torch reference: {g['equal']}/{len(g['prompts'])} "
            f"prompts identical over up to {g['new_tokens']} tokens; {g['near_ties']} diverge at a near-tie"
        )
        for p in g["prompts"]:
            if not p["equal"]:
                m = p.get("reference_margin")
                lines.append(
                    f"  - {p['prompt']}: first divergence at token {p['first_divergence']}, reference "
                    f"top-1/top-2 logit margin {_fmt(m, '.3f')}"
                )
    sets = q.get("perplexity", {}).get("sets", {})
    if sets:
        keys = list(next(iter(sets.values()))["pooled_vs_fp16"])
        lines += [
            "",
            "| question set | " + " | ".join(names.get(k, k) for k in keys) + " |",
            "|---|" + "---:|" * len(keys),
        ]
        for name, s in sets.items():
            lines.append(
                f"| {name} ({s['questions']} questions, {s['scored_tokens']} tokens) | "
                + " | ".join(f"{100 * s['pooled_vs_fp16'][k]:+.1f}%" for k in keys)
                + " |"
            )
    return lines


def markdown(result) -> str:
    m = result["meta"]
    ratios = m.get("prompt_bytes_ratio", {})
    head = [
        f"# Serving {m.get('model')} on {m.get('device')}",
        "",
        f"torch {m.get('torch')}, mixkv {m.get('mixkv')}, FlashInfer {m.get('flashinfer')}; CUDA graphs "
        f"{'on' if m.get('graphs', {}).get('on') else 'off'}; prompt KV bytes x FP16: "
        + ", ".join(f"{m['plans'].get(k, k)} {v:.3f}" for k, v in ratios.items()),
        "",
    ]
    if m.get("skipped"):
        head += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in m["skipped"].items()), ""]
    return (
        "\n".join(
            head
            + table(result)
            + ["", "Targets (decode tokens/s):", ""]
            + targets(result)
            + [""]
            + quality_lines(result)
        )
        + "\n"
    )


def plot(result, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, field, title in ((axes[0], "decode_tok_s", "decode-only steps"), (axes[1], "output_tok_s", "end to end")):
        for key in dict.fromkeys(r["plan"] for r in runs):
            pts = sorted((r["budget_gib"], r[field]) for r in runs if r["plan"] == key and r.get(field))
            if not pts:
                continue
            style = "--" if key.startswith("flashinfer") else "-"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                marker="o",
                label=runs and next(r["name"] for r in runs if r["plan"] == key),
            )
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget_gib"] for r in runs})
        ax.set_xticks(budgets)
        ax.set_xticklabels([f"{b:g}" for b in budgets])
        ax.set_xlabel("KV budget (GiB)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"tokens/s, {title}")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['meta'].get('model')} on {result['meta'].get('device')}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def render(result, png=None, md=None):
    if md:
        with open(md, "w") as f:
            f.write(markdown(result))
    if png:
        try:
            plot(result, png)
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    render(result, args.png, args.md)
    print(markdown(result))


if __name__ == "__main__":
    main()
