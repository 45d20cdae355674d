"""Scoring without stepping and the report: the plan sweep (perplexity vs
KV bytes for more plans, chunk-scored), the question sets (every plan on 16
more questions, pooled per set) and the printed tables."""

from __future__ import annotations

import mixkv
import numpy as np
from mixkv import Precision
from model import SmolLM2
from planning import (
    FLOOR_COUNTS,
    SWEEP_FLOOR_BUDGETS,
    error_floors_name,
    floored_plan,
    floors_within_budget,
    per_layer_plan,
    question_attention_error,
    top_layers,
    uniform_plan,
    variant_plans,
    windowquant_plan,
)
from progress import tqdm
from readback import cache_config, chunk_score
from task import QUESTION_SETS, WINDOW, Prompt, read_questions, read_text


def sweep(
    model,
    prompt,
    ks,
    vs,
    sens,
    embeddings,
    args,
    config,
    progress,
    passage_window,
    qa_scores,
    measured,
    attn,
    prompt_measured,
    question_error,
    prompt_kl,
    calibration_kl,
):
    """Perplexity vs KV bytes for more plans, each scored in one causal chunk
    over the K/V read back from mixkv's CPU blocks (score_with_past), not by
    stepping. The uniform plans are scored the same way too, as a check
    against their decoded figures."""
    c = model.config
    configs = [
        (p.name, uniform_plan(c.num_layers, prompt, p)) for p in (Precision.FP16, Precision.INT4, Precision.INT2)
    ]
    for a in [float(x) for x in args.sweep.split(",") if x.strip()]:
        configs.append((f"WindowQuant alpha={a:g}", windowquant_plan(prompt, embeddings, sens, a, "none")[0]))
    if args.sweep:
        configs.append(
            ("WindowQuant alpha=2, min-max scores", windowquant_plan(prompt, embeddings, sens, 2.0, "minmax")[0])
        )
        for a in (2.0, 32.0):
            configs.append((f"query-aware x eq. 9 s_l, alpha={a:g}", per_layer_plan(qa_scores, sens, a)))
        for a in (8.0, 32.0):
            configs.append((f"query-aware x measured s_l, alpha={a:g}", per_layer_plan(qa_scores, measured, a)))
        # The paper's window scores (eq. 8 on input embeddings) with the
        # measured sensitivities in place of eq. 9.
        for a in (2.0, 8.0, 32.0):
            configs.append(
                (
                    f"WindowQuant (eq. 8) x measured s_l, alpha={a:g}",
                    windowquant_plan(prompt, embeddings, measured, a, "none")[0],
                )
            )
        # INT4 floors on the k layers where INT2 moves the question's attention
        # most (the paper's plan, alpha of the run, elsewhere), and the same
        # error as a sensitivity in eqs. 10-11.
        for k in FLOOR_COUNTS:
            configs.append(
                (
                    f"INT4 floor on the {k} layers of largest question error",
                    floored_plan(model, prompt, embeddings, sens, args.alpha, top_layers(question_error, k)),
                )
            )
        error_s = 1.0 - np.asarray(question_error) / max(question_error)
        for a in (2.0, 8.0, 32.0):
            configs.append(
                (
                    f"eq. 8 x (1 - question error / max), alpha={a:g}",
                    windowquant_plan(prompt, embeddings, error_s, a, "none")[0],
                )
            )
    if args.diagnose:
        for a in (2.0, 8.0, 32.0):
            configs.append((f"diagnose: attention mass x measured s_l, alpha={a:g}", per_layer_plan(attn, measured, a)))
        for a in (8.0, 32.0):
            configs.append(
                (
                    f"diagnose: eq. 8 x prompt-measured s_l, alpha={a:g}",
                    windowquant_plan(prompt, embeddings, prompt_measured, a, "none")[0],
                )
            )
        for label, values in (("calibration", calibration_kl), ("prompt", prompt_kl)):
            for k in FLOOR_COUNTS:
                configs.append(
                    (
                        f"diagnose: INT4 floor on the {k} layers of largest {label} KL",
                        floored_plan(model, prompt, embeddings, sens, args.alpha, top_layers(values, k)),
                    )
                )
        windows = prompt.layout.num_windows(WINDOW)
        for first in range(0, c.num_layers, 5):
            plan = uniform_plan(c.num_layers, prompt, Precision.INT4)
            for layer in range(first, min(first + 5, c.num_layers)):
                for w in range(windows):
                    plan.set(layer, w, Precision.INT2)
            configs.append(
                (f"diagnose: INT2 in layers {first}-{min(first + 5, c.num_layers) - 1}, INT4 elsewhere", plan)
            )
        for rest in (Precision.INT2, Precision.INT4):
            plan = uniform_plan(c.num_layers, prompt, rest)
            for layer in range(c.num_layers):
                plan.set(layer, 0, Precision.FP16)
                plan.set(layer, passage_window, Precision.FP16)
            configs.append((f"diagnose: windows 0 and {passage_window} (the passage) FP16, rest {rest.name}", plan))
    cache = mixkv.KVCache(config)
    return [
        dict(name=name, **chunk_score(model, cache, prompt, plan, ks, vs))
        for name, plan in tqdm(configs, desc="sweep (read back)", disable=not progress)
    ]


def pooled_vs_fp16(questions, plan: str) -> float:
    """A plan's perplexity over all the questions' answers taken as one text,
    relative to FP16's (0.02 = +2%): exp of the scored-token-weighted mean of
    log(ppl / ppl_FP16). Each answer's first token is not scored (chunk_score)."""
    weights = np.array([q["answer_tokens"] - 1 for q in questions], dtype=float)
    logs = np.array([np.log(q["plans"][plan]["ppl"] / q["plans"]["FP16"]["ppl"]) for q in questions])
    return float(np.exp(weights @ logs / weights.sum()) - 1.0)


def question_set(model: SmolLM2, name: str, sens, measured, alpha: float, progress: bool):
    """Every decode variant and the floors within SWEEP_FLOOR_BUDGETS,
    chunk-scored on each question of texts/<name>; the plans that depend on
    the question (eq. 8 scores, the question attention error and its floors)
    are made again for each."""
    out = []
    for question, answer in tqdm(read_questions(name), desc=name, disable=not progress):
        prompt = Prompt(model.tokenizer, read_text("constitution_article1.txt"), question, answer)
        _, ks, vs, _ = model.prefill(prompt.ids)
        embeddings = model.embedding[np.asarray(prompt.ids)]
        error = question_attention_error(model, prompt, ks, vs)
        plans, _, _, floored = variant_plans(model, prompt, embeddings, sens, alpha, "none", None, measured, error)
        for budget in SWEEP_FLOOR_BUDGETS:
            plans[error_floors_name(budget)], floored[f"{budget:g}"] = floors_within_budget(
                model, prompt, embeddings, sens, alpha, error, budget
            )
        cache = mixkv.KVCache(cache_config(model, prompt.layout, list(plans.values()), 0, 1))
        out.append(
            {
                "question": question,
                "answer_tokens": len(prompt.answer),
                "floored_layers": floored,
                "plans": {n: chunk_score(model, cache, prompt, plan, ks, vs) for n, plan in plans.items()},
            }
        )
    return out


def question_sets(model: SmolLM2, sens, measured, alpha: float, progress: bool):
    sets = []
    for name, path, written in QUESTION_SETS:
        questions = question_set(model, path, sens, measured, alpha, progress)
        pooled = {plan: pooled_vs_fp16(questions, plan) for plan in questions[0]["plans"]}
        sets.append({"name": name, "file": path, "written": written, "questions": questions, "pooled_vs_fp16": pooled})
    return sets


def report(r):
    print()
    print(
        f"document {r['document_tokens']} tokens, {r['windows']} windows; continuation {r['continuation_tokens']} tokens"
    )
    print(f"eq. 8 passage window {r['passage_window']}: rank {r['passage_window_rank']} of {r['windows']} by score")
    for v, n in r["windows_by_precision"].items():
        print(f"{v}: (layer, window) pairs at FP16 / INT4 / INT2: {n}")
    print(f"FP16 greedy answer: {r['greedy_fp16']!r}")
    print(
        f"FP16 (mixkv) == dense greedy tokens: {r['fp16_equals_dense']} over {r['fp16_dense_tokens']} tokens; "
        f"max |logit gap| {r['max_logit_gap_fp16_vs_dense']:.2e}"
    )
    print()
    print(
        "| storage | KV bytes | x FP16 | perplexity | vs FP16 | top-1 agreement (continuation) | greedy agreement | identical greedy prefix |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = r["rows"][0]["ppl"]
    for row in r["rows"]:
        print(
            f"| {row['variant']} | {row['kv_bytes'] / 2**20:.2f} MiB | {row['bytes_ratio']:.3f} | {row['ppl']:.3f} | "
            f"{100 * (row['ppl'] / base - 1):+.1f}% | {100 * row['cont_agreement']:.1f}% | "
            f"{100 * row['greedy_agreement']:.1f}% | {row['greedy_identical_prefix']}/{row['greedy_len']} |"
        )
    for s in r.get("sweep", []):
        print(
            f"sweep (chunk-scored): {s['name']:38s} x{s['bytes_ratio']:.3f}  perplexity {s['ppl']:.3f} "
            f"({100 * (s['ppl'] / base - 1):+.1f}%)"
        )
    for qs in r.get("question_sets", []):
        for q in qs["questions"]:
            fp16 = q["plans"]["FP16"]["ppl"]
            print(f"{qs['name']} question (chunk-scored, {q['answer_tokens']} answer tokens): {q['question']}")
            for name, p in q["plans"].items():
                print(
                    f"  {name:72s} x{p['bytes_ratio']:.3f}  perplexity {p['ppl']:.3f} "
                    f"({100 * (p['ppl'] / fp16 - 1):+.1f}%)"
                )
        tokens = sum(q["answer_tokens"] - 1 for q in qs["questions"])
        print(f"{qs['name']} set, {len(qs['questions'])} questions, pooled over {tokens} scored tokens:")
        for name, v in qs["pooled_vs_fp16"].items():
            ratios = [q["plans"][name]["bytes_ratio"] for q in qs["questions"]]
            print(f"  {name:72s} x{min(ratios):.3f}-{max(ratios):.3f}  {100 * v:+.1f}%")
    print(
        f"\nprefill {r['prefill_seconds']:.0f} s, decode {r['decode_steps']} steps in {r['decode_seconds']:.0f} s "
        f"({r['backend']} backend), total {r['seconds']:.0f} s"
    )
