"""Side by side: mixkv's extend attention (extend_bench.cpp's JSON) and
FlashInfer's paged prefill / torch SDPA (flashinfer_prefill_bench.py's JSON)
on the issue's shapes, checked against the issue's targets:
  1. mixkv FP16 within 1.1x of FlashInfer FP16 (its faster backend, fa2 or fa3);
  2. INT4 and INT2 on long chunks (n >= 512) within 1.15x of mixkv FP16;
  3. 8-token verification on quantized pools >= 85% of the read bandwidth
     (mixkv's own read kernel, measured in the same program as its timings).
Writes a markdown report (--md) and, where matplotlib is installed, a bar chart
(--png): time per shape, lower is better.

  python3 benchmarks/plot_extend.py extend_bench.json flashinfer_prefill_bench.json \
      --md extend.md --png extend.png
Either JSON may be missing (a failed run): what is there is reported.
"""

import argparse
import json
import os

SHAPE_ORDER = ["chunk2048_b1", "chunk2048_b8", "chunk512_b32", "verify8_b64"]
PLANS = ["fp16", "int4", "int2", "mixed"]


def load(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(x, digits=1):
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def check(ok):
    return "-" if ok is None else ("yes" if ok else "**no**")


def collect(mixkv, fi):
    """Per shape: {label: entry}."""
    table = {}
    if mixkv:
        for e in mixkv.get("extend", []):
            table.setdefault(e["shape"], {})["mixkv " + e["plan"]] = e
    if fi:
        for e in fi.get("results", []):
            if "time_us" not in e:
                continue
            if e["variant"] == "sdpa":
                label = "SDPA fp16" + (" (K/V repeated)" if e.get("path") == "kv_repeated" else "")
            else:
                label = f"FlashInfer {e['variant']} p{e['page_size']} {e['layout']}"
            table.setdefault(e["shape"], {})[label] = e
    return table


def best(entries, prefix):
    """The fastest entry whose label starts with prefix: (label, entry) or (None, None)."""
    found = [(e["time_us"], label, e) for label, e in entries.items() if label.startswith(prefix)]
    if not found:
        return None, None
    found.sort(key=lambda t: t[0])
    return found[0][1], found[0][2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mixkv_json")
    ap.add_argument("flashinfer_json")
    ap.add_argument("--md", default="extend.md")
    ap.add_argument("--png", default="extend.png")
    args = ap.parse_args()
    mixkv, fi = load(args.mixkv_json), load(args.flashinfer_json)
    table = collect(mixkv, fi)
    shapes = [s for s in SHAPE_ORDER if s in table] + sorted(s for s in table if s not in SHAPE_ORDER)
    bw = mixkv.get("read_bandwidth_gbps") if mixkv else None

    lines = ["# Extend attention: mixkv vs FlashInfer 0.7.2.post1 and torch SDPA", ""]
    if mixkv:
        lines.append(
            f"mixkv: {mixkv.get('device')}, read bandwidth {fmt(bw, 0)} GB/s (own kernel), "
            f"L2 flush {mixkv.get('l2_flush')}, median of {mixkv.get('reps')}; block 32."
        )
    else:
        lines.append(f"mixkv: no results ({args.mixkv_json} missing).")
    if fi:
        lines.append(
            f"FlashInfer {fi.get('flashinfer')} / torch {fi.get('torch')}: L2 flush {fi.get('l2_flush')}, "
            f"median of {fi.get('reps')}; torch read bandwidth {fmt(fi.get('torch_read_bandwidth_gbps'), 0)} GB/s."
        )
        skipped = [e for e in fi.get("results", []) if "time_us" not in e]
        for e in skipped:
            lines.append(f"- skipped: {e['shape']} {e['variant']}: {e.get('error', '')[:200]}")
    else:
        lines.append(f"FlashInfer: no results ({args.flashinfer_json} missing).")
    lines += [
        "",
        "Shapes: 28 query / 4 KV heads, head_dim 128; n new rows per sequence over ctx cached tokens, "
        "causal among the new rows. TFLOP/s = 4 * 28 * 128 * sum_i n_i (ctx_i + (n_i + 1) / 2) / time.",
        "",
        "## Times (us) and TFLOP/s",
        "",
    ]
    labels = []
    for s in shapes:
        for label in table[s]:
            if label not in labels:
                labels.append(label)
    lines.append("| shape | " + " | ".join(labels) + " |")
    lines.append("|---|" + "---|" * len(labels))
    for s in shapes:
        cells = []
        for label in labels:
            e = table[s].get(label)
            cells.append("-" if e is None else f"{fmt(e['time_us'])} ({fmt(e.get('tflops'), 0)})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")

    lines += ["", "## Against the targets", ""]
    lines.append(
        "| shape | mixkv FP16 / FlashInfer FP16 (best) | <= 1.1x | INT4 / FP16 | INT2 / FP16 | mixed / FP16 "
        "| long chunk <= 1.15x | FP16 %BW | INT4 %BW | INT2 %BW | mixed %BW | verify >= 85% |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {"fp16_vs_flashinfer": [], "quantized_long_chunks": [], "verify_bandwidth": []}
    for s in shapes:
        entries = table[s]
        mk = {p: entries.get("mixkv " + p) for p in PLANS}
        fi_label, fi_best = best(entries, "FlashInfer fp16")
        r_fi = mk["fp16"]["time_us"] / fi_best["time_us"] if mk["fp16"] and fi_best else None
        ok_fi = None if r_fi is None else r_fi <= 1.1
        ratios = {p: (mk[p]["time_us"] / mk["fp16"]["time_us"] if mk[p] and mk["fp16"] else None) for p in PLANS}
        n_new = next((e.get("n_new") for e in entries.values() if e.get("n_new")), 0)
        long_chunk = n_new >= 512
        ok_long = None
        if long_chunk and ratios["int4"] is not None and ratios["int2"] is not None:
            ok_long = ratios["int4"] <= 1.15 and ratios["int2"] <= 1.15
        pct = {p: (mk[p].get("pct_bw") if mk[p] else None) for p in PLANS}
        verify = s.startswith("verify")
        ok_verify = None
        if verify and pct["int4"] is not None and pct["int2"] is not None:
            ok_verify = pct["int4"] >= 85 and pct["int2"] >= 85
        fi_note = f" vs {fi_label.replace('FlashInfer ', '')}" if fi_label else ""
        lines.append(
            f"| {s} | {fmt_ratio(r_fi)}{fi_note} | {check(ok_fi)} | {fmt_ratio(ratios['int4'])} | "
            f"{fmt_ratio(ratios['int2'])} | {fmt_ratio(ratios['mixed'])} | {check(ok_long) if long_chunk else 'n/a'} | "
            f"{fmt(pct['fp16'])} | {fmt(pct['int4'])} | {fmt(pct['int2'])} | {fmt(pct['mixed'])} | "
            f"{check(ok_verify) if verify else 'n/a'} |"
        )
        if ok_fi is not None:
            summary["fp16_vs_flashinfer"].append(ok_fi)
        if ok_long is not None:
            summary["quantized_long_chunks"].append(ok_long)
        if ok_verify is not None:
            summary["verify_bandwidth"].append(ok_verify)
    lines += ["", "Targets met:"]
    names = {
        "fp16_vs_flashinfer": "FP16 within 1.1x of FlashInfer FP16",
        "quantized_long_chunks": "INT4/INT2 long chunks within 1.15x of mixkv FP16",
        "verify_bandwidth": "8-token verification on INT4/INT2 >= 85% of read bandwidth",
    }
    for key, oks in summary.items():
        state = "not measured" if not oks else f"{sum(oks)} of {len(oks)} shapes"
        lines.append(f"- {names[key]}: {state}")
    verify_shapes = [s for s in shapes if s.startswith("verify")]
    if verify_shapes and bw:
        lines += [
            "",
            f"Verification: bytes read once over the time, as % of mixkv's read bandwidth ({fmt(bw, 0)} GB/s):",
            "",
        ]
        lines.append("| shape | variant | us | MB read | GB/s | % of read bandwidth |")
        lines.append("|---|---|---|---|---|---|")
        for s in verify_shapes:
            for label, e in table[s].items():
                nbytes = e.get("bytes_read")
                gbps = nbytes / e["time_us"] / 1e3 if nbytes else None
                lines.append(
                    f"| {s} | {label} | {fmt(e['time_us'])} | {fmt(nbytes / 1e6 if nbytes else None)} | "
                    f"{fmt(gbps, 0)} | {fmt(100.0 * gbps / bw if gbps else None)} |"
                )
    if fi:
        lines += ["", "FlashInfer FP8 (e4m3 KV, FP16 queries, fa2) against mixkv INT4 / INT2:", ""]
        lines.append("| shape | FlashInfer FP8 us | mixkv INT4 us | mixkv INT2 us | INT4 speed-up | INT2 speed-up |")
        lines.append("|---|---|---|---|---|---|")
        for s in shapes:
            _, fp8 = best(table[s], "FlashInfer fp8")
            i4, i2 = table[s].get("mixkv int4"), table[s].get("mixkv int2")
            if fp8 is None:
                continue
            lines.append(
                f"| {s} | {fmt(fp8['time_us'])} | {fmt(i4['time_us'] if i4 else None)} | "
                f"{fmt(i2['time_us'] if i2 else None)} | "
                f"{fmt_ratio(fp8['time_us'] / i4['time_us'] if i4 else None)} | "
                f"{fmt_ratio(fp8['time_us'] / i2['time_us'] if i2 else None)} |"
            )
    with open(args.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.md}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not shapes:
        print("no results: no plot")
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4.6), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        entries = table[s]
        bars = [(label.replace("FlashInfer ", "FI "), e["time_us"]) for label, e in entries.items()]
        colors = [
            "#1f77b4" if b[0].startswith("mixkv") else ("#d62728" if b[0].startswith("FI") else "#7f7f7f") for b in bars
        ]
        ax.bar(range(len(bars)), [b[1] for b in bars], color=colors)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([b[0] for b in bars], rotation=60, ha="right", fontsize=7)
        ax.set_title(s, fontsize=10)
        ax.set_ylabel("us (lower is better)")
        for i, b in enumerate(bars):
            ax.text(i, b[1], f"{b[1]:.0f}", ha="center", va="bottom", fontsize=6)
    fig.suptitle("Extend attention, 28 q / 4 KV heads, head_dim 128 (L2 flushed, median)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
