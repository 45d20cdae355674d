"""Quality beside speed, through the same serving loop:

- greedy_check: the FP16 plan's greedy tokens (served: prefill through the
  cache, decode through CUDA graphs and the backend's attention) against
  DenseReference's (a dense float16 cache, float32 attention). Equal, or
  the first divergence and the reference's top-1 minus top-2 logit margin
  there: a divergence at a margin within float16 rounding of the logits is
  a near-tie, not an error of the cache.
- perplexity: every plan teacher-forced on the reference answers of the
  question sets (examples/smollm2/texts/*_questions.txt), each question a
  request of one engine per plan; per question the perplexity of the answer
  after its first token (as examples/smollm2's chunk scoring counts it), per
  set the pooled change against FP16 (evaluation.pooled_vs_fp16).
"""

from __future__ import annotations

import math

import numpy as np
from loop import serve
from torch_model import DenseReference
from workload import FLASHINFER_PLANS, Request

# A divergence where the reference's two best logits are closer than this is a near-tie: the logits are
# float16 products (spacing 1/64 at 16..32), and mixkv's and the reference's attention outputs differ in
# their last float16 bit.
NEAR_TIE = 0.05


def quality_budget(book, key, prompts, new_tokens: int) -> int:
    """A budget holding every prompt at FP16 and its new tokens, with room to spare: quality runs never
    preempt."""
    need = sum(book.request_bytes("fp16", p, new_tokens) for p in prompts)
    return int(max(need * 1.5, 256 << 20))


def greedy_check(runner, book, prompts, new_tokens: int, keys, backend_for, eos_id: int, progress=None):
    """{key: {"equal": n of prompts, "prompts": [...]}} for each plan in `keys` (FP16 ones), against the dense
    reference. backend_for(key, budget_bytes) makes a backend."""
    ref_tokens, ref_margins = DenseReference(runner.model).generate([p.ids for p in prompts], new_tokens, True)
    out = {}
    for key in keys:
        reqs = [
            Request(f"g{i}", p, new_tokens, plan=None if key in FLASHINFER_PLANS else book.plan(key, p))
            for i, p in enumerate(prompts)
        ]
        backend = backend_for(key, quality_budget(book, key, prompts, new_tokens))
        try:
            res = serve(runner, backend, reqs, stop_at_eos=True, eos_id=eos_id, progress=progress)
        finally:
            backend.close()
        rows = []
        for i, p in enumerate(prompts):
            mine, ref = res["tokens"][f"g{i}"], ref_tokens[i]
            if mine == ref:
                rows.append({"prompt": p.name, "tokens": len(ref), "equal": True})
                continue
            d = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            margin = ref_margins[i][d] if d < len(ref_margins[i]) else None
            rows.append(
                {
                    "prompt": p.name,
                    "tokens": len(ref),
                    "equal": False,
                    "first_divergence": d,
                    "reference_margin": margin,
                    "near_tie": margin is not None and margin < NEAR_TIE,
                }
            )
        out[key] = {
            "equal": sum(r["equal"] for r in rows),
            "near_ties": sum(bool(r.get("near_tie")) for r in rows),
            "prompts": rows,
            "new_tokens": new_tokens,
        }
    return out


def perplexity(runner, book, prompts, keys, backend_for, progress=None):
    """{key: {question name: perplexity}} and, per question set, the pooled change against FP16."""
    from evaluation import pooled_vs_fp16

    per_key = {}
    for key in keys:
        reqs = []
        for i, p in enumerate(prompts):
            if len(p.answer) < 2:
                raise ValueError(f"prompt {p.name}: a scored answer needs >= 2 tokens")
            plan = None if key in FLASHINFER_PLANS else book.plan(key, p)
            reqs.append(Request(f"q{i}", p, len(p.answer), plan=plan, forced=list(p.answer)))
        longest = max(len(p.answer) for p in prompts)
        backend = backend_for(key, quality_budget(book, key, prompts, longest))
        try:
            res = serve(runner, backend, reqs, progress=progress)
        finally:
            backend.close()
        per_key[key] = {}
        for i, p in enumerate(prompts):
            lp = res["logprobs"][f"q{i}"]
            if len(lp) != len(p.answer):
                raise RuntimeError(f"{key}: {p.name}: {len(lp)} log-probs for {len(p.answer)} answer tokens")
            per_key[key][p.name] = float(math.exp(-np.mean(lp[1:])))
    sets = {}
    if "fp16" in per_key:
        for name in dict.fromkeys(p.question_set for p in prompts):
            members = [p for p in prompts if p.question_set == name]
            questions = [
                {"answer_tokens": len(p.answer), "plans": {k: {"ppl": per_key[k][p.name]} for k in per_key}}
                for p in members
            ]
            # FP16 is the reference of every plan, the FlashInfer ones included.
            questions = [{**q, "plans": {"FP16": q["plans"]["fp16"], **q["plans"]}} for q in questions]
            sets[name] = {
                "questions": len(members),
                "scored_tokens": sum(len(p.answer) - 1 for p in members),
                "pooled_vs_fp16": {k: pooled_vs_fp16(questions, k) for k in per_key},
            }
    return {"per_question": per_key, "sets": sets}
