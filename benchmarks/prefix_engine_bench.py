"""Prefix caching through the engine loop: a multi-turn video-QA trace served
by mixkv.Engine with a torch model of SmolLM2-135M's shapes (random weights,
examples/serving/torch_model.py), on the GPU or the CPU, wall clock.

Trace (seeded, the same for every run): --videos videos, --videos x
--questions requests, each request's video drawn by Zipf(1.0) popularity,
arriving --arrivals-per-step requests a step on average (Poisson), in engine
steps. A prompt is a system text of --system-tokens rows (a multiple of the
block size, so that the prefix can reach into the video) | a video of
--frames x --tokens-per-frame visual rows | a 10-40 token question; each
request generates a number of tokens drawn from --new-tokens. Keys
(Request.token_keys): the token id of a text row, a 64-bit hash of (video,
row) for a visual row. Each question has its own WindowQuant-like plan: per
(layer, window) FP16 / INT4 / INT2 from a random score (about 10 / 30 / 60 %,
thresholds shifted per layer), window 0 FP16.

Runs, one after the other in one process (--runs picks; the first three by
default):
  off           FP16 plans, prefix caching off
  fp16-prefix   FP16 plans, prefix caching on (precision identity, Compact):
                what a vLLM-like engine offers
  wq-content    WindowQuant plans, prefix caching by content (identity
                Content, PrefillMode.Exact, fp16_windows_first, higher Demote)
  wq-off        WindowQuant plans, prefix caching off (Compact)
  wq-precision  WindowQuant plans, prefix caching by precision (Compact)

Metrics per run: prompt rows computed (recomputes after preemption
included) against the rows the trace asks, the share of processed prompt
rows taken from the cache (SchedulerStats.cached_prompt_tokens over those
plus prefill_tokens), TTFT p50/p99 (wall clock from the start of the step in
which the request arrived to the end of the step that sampled its first
token; sampled tokens are copied to the host, which synchronises the GPU;
also in steps), decode tokens/s (rows of decode-only steps over their wall
time) and output tokens/s (every token over the run's wall time),
preemptions, and cached videos per GiB at the end: the bytes the prefix
index holds (PrefixCacheStats.cached blocks per pool x the pool's block
bytes), and the videos held, measured by probes. match_prefix is not bound
in Python, so after the trace (the bytes taken first) each video asked gets
one probe request, a new question with a plan of the run's kind, served to
its first token on its own; the video counts as held when the probe's
RequestStatus.cached_tokens reaches the video's last full block. Probes run
one at a time and may publish blocks of their own, which later probes of
other videos do not use; a probe that had to evict cached blocks is counted
in probe_evicted (the figure is then a lower bound).

  python benchmarks/prefix_engine_bench.py [--device cuda|cpu] [--videos 32] [--questions 8]
      [--frames 16] [--tokens-per-frame 196] [--quick] [--out benchmarks/results/prefix_engine.json]

Writes JSON after every run, so a run cut short keeps what it measured.
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
from graphs import ModelRunner  # noqa: E402
from progress import tqdm  # noqa: E402
from serving_bench import parse_new_tokens, pick_device  # noqa: E402
from torch_model import SMOLLM2_135M, Config, TorchSmolLM2  # noqa: E402
from video_qa_trace import Trace  # noqa: E402

ALL_RUNS = {
    "off": "FP16 plans, no prefix cache",
    "fp16-prefix": "FP16 plans, prefix cache (vLLM-like)",
    "wq-content": "WindowQuant, prefix cache by content",
    "wq-off": "WindowQuant, no prefix cache",
    "wq-precision": "WindowQuant, prefix cache by precision",
}
DEFAULT_RUNS = "off,fp16-prefix,wq-content"
# Tiny shapes for --quick (SmolLM2's layout: GQA 3:1, head_dim 64), seconds on a 2-core CPU.
TINY = Config(num_layers=4, hidden=192, ffn=384, num_heads=3, num_kv_heads=1, head_dim=64, vocab=4096)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--videos", type=int, default=None, help="distinct videos (default 32; --quick 4)")
    ap.add_argument("--questions", type=int, default=None, help="questions per video on average (default 8; --quick 4)")
    ap.add_argument("--frames", type=int, default=None, help="frames per video (default 16; --quick 2)")
    ap.add_argument(
        "--tokens-per-frame", type=int, default=None, help="visual tokens per frame (default 196; --quick 64)"
    )
    ap.add_argument("--system-tokens", type=int, default=32, help="system text rows (a multiple of --block-size)")
    ap.add_argument("--new-tokens", default=None, help="lo,hi: new tokens per request (default 32,64; --quick 4,8)")
    ap.add_argument("--arrivals-per-step", type=float, default=None, help="mean arrivals a step (default 2)")
    ap.add_argument("--arena-gib", type=float, default=None, help="KV arena (default 16; --quick 0.0625)")
    ap.add_argument("--block-size", type=int, default=32, help="block = window rows")
    ap.add_argument("--max-batch", type=int, default=None, help="largest decode batch (default 256; --quick 16)")
    ap.add_argument("--step-tokens", type=int, default=None, help="rows a step computes at most (default 16384)")
    ap.add_argument("--model", default=None, choices=("smollm2", "tiny"), help="shapes (default smollm2; --quick tiny)")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated: " + ",".join(ALL_RUNS))
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--no-probe", action="store_true", help="skip the videos-held probes")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and trace: under a minute on a 2-core CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefix_engine.json"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(
        videos=4 if q else 32,
        questions=4 if q else 8,
        frames=2 if q else 16,
        tokens_per_frame=64 if q else 196,
        new_tokens="4,8" if q else "32,64",
        arrivals_per_step=2.0,
        arena_gib=1 / 16 if q else 16.0,
        max_batch=16 if q else 256,
        step_tokens=4096 if q else 16384,
        model="tiny" if q else "smollm2",
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for name in ("videos", "questions", "frames", "tokens_per_frame", "max_batch", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.system_tokens < 1 or args.system_tokens % args.block_size:
        ap.error(f"--system-tokens {args.system_tokens}: expected a positive multiple of --block-size")
    if args.step_tokens < args.block_size:
        ap.error(f"--step-tokens {args.step_tokens}: expected >= --block-size")
    if args.arrivals_per_step <= 0 or args.arena_gib <= 0:
        ap.error("--arrivals-per-step and --arena-gib: expected > 0")
    args.new_range = parse_new_tokens(ap, args.new_tokens)
    args.run_list = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in args.run_list:
        if r not in ALL_RUNS:
            ap.error(f"--runs: unknown run {r!r} (expected some of {', '.join(ALL_RUNS)})")
    if not args.run_list:
        ap.error("--runs: expected at least one run")
    return args


# ---- one run -----------------------------------------------------------------------------------------------------
RUN_SETUP = {
    # name: (plan kind, prefix enabled, identity, prefill mode)
    "off": ("fp16", False, "Precision", "Compact"),
    "fp16-prefix": ("fp16", True, "Precision", "Compact"),
    "wq-content": ("wq", True, "Content", "Exact"),
    "wq-off": ("wq", False, "Precision", "Compact"),
    "wq-precision": ("wq", True, "Precision", "Compact"),
}


def make_engine(args, model, device, run, longest):
    kind, enabled, identity, mode = RUN_SETUP[run]
    c = model.config
    shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size)
    prefix = mixkv.PrefixCacheConfig(enabled=enabled)
    if identity != "Precision":
        if not hasattr(mixkv, "PrefixIdentity"):
            raise RuntimeError("mixkv.PrefixIdentity is missing: this build has no content identity")
        prefix.identity = getattr(mixkv.PrefixIdentity, identity)
        prefix.higher = mixkv.PrefixHigher.Demote
    cache = mixkv.CacheConfig(shape, int(args.arena_gib * (1 << 30)), fp16_windows_first=True, prefix_cache=prefix)
    sched = mixkv.SchedulerConfig(
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=args.step_tokens,
        demote_under_pressure=False,
        preemption=mixkv.PreemptionMode.Recompute,
        prefill_mode=getattr(mixkv.PrefillMode, mode),
    )
    engine = mixkv.Engine(
        cache,
        sched,
        num_q_heads=c.num_heads,
        backend="cuda" if device.type == "cuda" else "cpu",
        device=device.index or 0,
        max_blocks_per_sequence=math.ceil(longest / args.block_size) + 2,
    )
    return engine, {
        "plans": kind,
        "prefix_cache": repr(cache.prefix_cache),
        "prefill_mode": mode,
        "fp16_windows_first": True,
        "arena_bytes": cache.arena_bytes,
    }


class Loop:
    """Continuous batching of (prompt, plan) requests through one engine and the torch model."""

    def __init__(self, runner, engine, device):
        self.runner = runner
        self.engine = engine
        self.device = device
        self.block_bytes = [engine.cache.format(p).block_bytes for p in mixkv.Precision]
        self.prompts = {}
        self.tokens = {}
        self.first = {}  # id -> (seconds, step) at its first token
        self.arrived = {}  # id -> (seconds, step)
        self.cached = {}  # id -> status.cached_tokens at its first chunk
        self.steps = []  # (kind, prefill rows, decode rows, seconds)
        self.step_index = 0
        self.preempted = 0

    def add(self, rid, prompt, plan, max_new, keyed):
        self.prompts[rid] = prompt
        self.tokens[rid] = []
        self.engine.add_request(
            rid, prompt.layout, plan=plan, max_new_tokens=int(max_new), token_keys=prompt.keys if keyed else None
        )

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, t_start):
        """One engine step through the model; returns the tokens sampled."""
        eng = self.engine
        step = eng.step()
        self.step_index += 1
        self.preempted += len(step.preempted)  # recompute: their prompt and tokens so far come back as chunks
        decodes = list(step.decodes)
        if not step.prefills and not decodes:
            return 0
        dec_ids = np.asarray([self.tokens[r][-1] for r in decodes], dtype=np.int64)
        dec_pos = np.asarray([self.prompts[r].num_tokens + len(self.tokens[r]) - 1 for r in decodes], dtype=np.int64)
        if step.prefills:
            ids, pos, sample_rows, samplers = [], [], [], []
            row = 0
            for chunk in step.prefills:
                rid = chunk.request_id
                p = self.prompts[rid]
                if rid not in self.cached:
                    self.cached[rid] = int(eng.status(rid).cached_tokens)
                full = (
                    p.ids
                    if chunk.end <= p.num_tokens
                    else np.concatenate([p.ids, np.asarray(self.tokens[rid], dtype=np.int64)])
                )
                ids.append(full[chunk.start : chunk.end])
                pos.append(np.arange(chunk.start, chunk.end, dtype=np.int64))
                row += chunk.end - chunk.start
                if chunk.last:
                    sample_rows.append(row - 1)
                    samplers.append(rid)
            num_prefill = row
            ids.append(dec_ids)
            pos.append(dec_pos)
            sample_rows += list(range(num_prefill, num_prefill + len(decodes)))
            samplers += decodes

            def attend(layer, q, k, v, p=num_prefill):
                out = eng.prefill(layer, q[:p], k[:p], v[:p])
                if q.shape[0] == p:
                    return out
                rest = torch.empty_like(q[p:])
                eng.attend(layer, q[p:], k[p:], v[p:], out=rest)
                return torch.cat([out, rest])

            t0 = time.perf_counter()
            best, _ = self.runner.eager(np.concatenate(ids), np.concatenate(pos), attend, sample_rows)
            kind = "mixed"
        else:
            num_prefill = 0
            t0 = time.perf_counter()
            best, _ = self.runner.decode(
                dec_ids, dec_pos, lambda layer, q, k, v, out: eng.attend(layer, q, k, v, out=out)
            )
            samplers = decodes
            kind = "decode"
        now = time.perf_counter()  # tokens are on the host: the GPU has finished the step
        self.steps.append((kind, num_prefill, len(decodes), now - t0))
        for i, rid in enumerate(samplers):
            if rid not in self.first:
                self.first[rid] = (now - t_start, self.step_index)
            self.tokens[rid].append(int(best[i]))
        return len(samplers)

    def index_bytes(self):
        s = self.engine.cache.prefix_stats()
        return sum(int(s.cached[p]) * self.block_bytes[p] for p in range(3)), s


def percentile_ms(values, q):
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else None


def serve_trace(args, trace, runner, device, run, bar):
    kind, enabled, _, _ = RUN_SETUP[run]
    longest = max(p.num_tokens for p in trace.requests) + args.new_range[1] + 64
    engine, config = make_engine(args, runner.model, device, run, longest)
    loop = Loop(runner, engine, device)
    n = len(trace.requests)
    plans = trace.plans(kind)
    loop.sync()
    t_start = time.perf_counter()
    nxt = 0
    step = 0
    while nxt < n or engine.has_unfinished():
        if not engine.has_unfinished() and nxt < n:
            step = max(step, int(trace.arrival_step[nxt]))  # idle: the next arrival comes now
        now = time.perf_counter() - t_start
        while nxt < n and trace.arrival_step[nxt] <= step:
            loop.add(nxt, trace.requests[nxt], plans[nxt], trace.new_tokens[nxt], enabled)
            loop.arrived[nxt] = (now, loop.step_index)
            nxt += 1
        bar.update(loop.step(t_start))
        step += 1
    loop.sync()
    wall = time.perf_counter() - t_start
    stats = engine.stats()
    held_bytes, pstats = loop.index_bytes()
    ttft = [loop.first[i][0] - loop.arrived[i][0] for i in range(n)]
    ttft_steps = [loop.first[i][1] - loop.arrived[i][1] for i in range(n)]
    dec = [s for s in loop.steps if s[0] == "decode"]
    dec_rows = sum(s[2] for s in dec)
    dec_s = sum(s[3] for s in dec)
    out_tokens = sum(len(t) for t in loop.tokens.values())
    asked = sum(p.num_tokens for p in trace.requests)
    computed = sum(s[1] for s in loop.steps)
    cached_rows = int(stats.cached_prompt_tokens)
    entry = {
        "run": run,
        "name": ALL_RUNS[run],
        "config": config,
        "requests": n,
        "prompt_tokens_asked": int(asked),
        "prefill_tokens_computed": int(computed),
        "scheduler_prefill_tokens": int(stats.prefill_tokens),
        "cached_prompt_tokens": cached_rows,
        "cache_share": cached_rows / (cached_rows + int(stats.prefill_tokens))
        if cached_rows + int(stats.prefill_tokens)
        else 0.0,
        "computed_vs_asked": computed / asked,
        "prefix_hits": int(stats.prefix_hits),
        "ttft_ms_p50": percentile_ms(ttft, 50),
        "ttft_ms_p99": percentile_ms(ttft, 99),
        "ttft_steps_p50": float(np.percentile(ttft_steps, 50)),
        "ttft_steps_p99": float(np.percentile(ttft_steps, 99)),
        "wall_s": wall,
        "steps": len(loop.steps),
        "decode_steps": len(dec),
        "decode_tok_s": dec_rows / dec_s if dec_s > 0 else None,
        "output_tokens": int(out_tokens),
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "preemptions": int(stats.preempted_recompute) + int(stats.preempted_swap),
        "plan_demotions": int(stats.plan_demotions),
        "index_cached_blocks": [int(x) for x in pstats.cached],
        "index_evicted_blocks": [int(x) for x in pstats.evicted],
        "index_bytes": int(held_bytes),
        "block_bytes": {p.name: loop.block_bytes[p] for p in mixkv.Precision},
        "videos_asked": int(len(set(int(v) for v in trace.video_of))),
    }
    if enabled and not args.no_probe:
        entry.update(probe_videos(args, trace, loop, kind))
    else:
        entry.update(videos_held=None, videos_per_gib=None, probe_evicted=None)
    del loop, engine
    return entry


def probe_videos(args, trace, loop, kind):
    """Videos held at the end: one probe a video asked (a new question), served to its first token alone."""
    engine = loop.engine
    held_bytes = loop.index_bytes()[0]
    evicted0 = sum(int(x) for x in engine.cache.prefix_stats().evicted)
    rng = np.random.default_rng(args.seed + 1)
    held, per_video = 0, {}
    for j, video in enumerate(sorted(set(int(v) for v in trace.video_of))):
        prompt = trace.prompt(video, rng)
        plan = trace.plan(kind, prompt, rng.integers(0, 2**63 - 1))
        rid = f"probe{j}"
        loop.add(rid, prompt, plan, 1, True)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            loop.step(t0)
        clean = prompt.video_end // args.block_size * args.block_size
        got = loop.cached.get(rid, 0)
        per_video[video] = got
        held += got >= clean
    evicted = sum(int(x) for x in engine.cache.prefix_stats().evicted) - evicted0
    gib = held_bytes / (1 << 30)
    return {
        "videos_held": int(held),
        "videos_per_gib": held / gib if gib > 0 else None,
        "probe_cached_rows": {str(k): v for k, v in per_video.items()},
        "probe_evicted": int(evicted),
    }


# ---- the bench -------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.device = pick_device(args.device)
        self.result = {"meta": {}, "runs": []}

    def log(self, msg):
        print(f"[{time.time() - self.t0:6.1f} s] {msg}", flush=True)

    def dump(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.result, f, indent=1)

    def setup(self):
        a = self.args
        config = TINY if a.model == "tiny" else SMOLLM2_135M
        torch.manual_seed(a.seed)
        self.trace = Trace(a, config.vocab, config.num_layers)
        longest = max(p.num_tokens for p in self.trace.requests) + a.new_range[1] + 64
        self.model = TorchSmolLM2.random(config, self.device, seed=a.seed, max_positions=max(longest, 1024))
        self.runner = ModelRunner(self.model, a.max_batch, graphs=self.device.type == "cuda" and not a.no_graphs)
        prompts = self.trace.requests
        self.result["meta"] = {
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "mixkv": mixkv.__version__,
            "has_prefix_identity": hasattr(mixkv, "PrefixIdentity"),
            "model": ("SmolLM2-135M shapes" if a.model == "smollm2" else "tiny") + " (random weights)",
            "model_config": {k: getattr(config, k) for k in config.__dataclass_fields__},
            "args": {k: v for k, v in vars(a).items() if k not in ("run_list", "new_range")},
            "trace": {
                "requests": len(prompts),
                "videos_asked": len(set(int(v) for v in self.trace.video_of)),
                "prompt_tokens": [min(p.num_tokens for p in prompts), max(p.num_tokens for p in prompts)],
                "video_rows": a.frames * a.tokens_per_frame,
                "steps_of_arrivals": int(self.trace.arrival_step[-1]) + 1,
            },
            "graphs": {"on": self.runner.use_graphs, "capture_s": self.runner.capture_seconds},
        }
        self.log(
            f"{self.result['meta']['model']} on {self.device}; {len(prompts)} requests on "
            f"{self.result['meta']['trace']['videos_asked']} videos, prompts "
            f"{self.result['meta']['trace']['prompt_tokens']} tokens"
        )
        self.dump()

    def warmup(self):
        """A few requests through an FP16 Compact engine and a WindowQuant Exact one: first-call costs (module
        loads, cuBLAS, the demote kernels) stay out of the measured runs."""
        a = self.args
        tr = self.trace
        longest = max(p.num_tokens for p in tr.requests) + a.new_range[1] + 64
        for run in ("off", "wq-off"):
            engine, _ = make_engine(a, self.model, self.device, run, longest)
            loop = Loop(self.runner, engine, self.device)
            kind = RUN_SETUP[run][0]
            for i in range(min(2, len(tr.requests))):
                loop.add(i, tr.requests[i], tr.plans(kind)[i], 2, False)
            t0 = time.perf_counter()
            while engine.has_unfinished():
                loop.step(t0)
            del loop, engine

    def runs(self):
        a = self.args
        self.warmup()
        for run in a.run_list:
            total = int(self.trace.new_tokens.sum())
            bar = tqdm(total=total, desc=ALL_RUNS[run], unit="tok", disable=a.no_progress, leave=False)
            try:
                e = serve_trace(a, self.trace, self.runner, self.device, run, bar)
            except Exception as ex:  # one failing run (e.g. content identity not built yet) must not end the others
                e = {"run": run, "name": ALL_RUNS[run], "error": f"{type(ex).__name__}: {str(ex)[:400]}"}
            finally:
                bar.close()
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self.result["runs"].append(e)
            self.dump()
            if "error" in e:
                self.log(f"{ALL_RUNS[run]}: {e['error']}")
            else:
                self.log(
                    f"{ALL_RUNS[run]:40s} computed {e['prefill_tokens_computed']:8d}/{e['prompt_tokens_asked']:d} "
                    f"from cache {100 * e['cache_share']:5.1f}%  TTFT p50 {e['ttft_ms_p50']:8.1f} p99 "
                    f"{e['ttft_ms_p99']:8.1f} ms  decode {e['decode_tok_s'] or 0:8.0f} tok/s  "
                    f"preempt {e['preemptions']}"
                )

    def table(self):
        """Every run's figures, and its ratios to the first run (the baseline) side by side."""
        ok = [e for e in self.result["runs"] if "error" not in e]
        if not ok:
            return ""
        base = ok[0]
        cols = [
            ("prefill computed", "prefill_tokens_computed", "{:.0f}"),
            ("from cache", "cache_share", "{:.1%}"),
            ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"),
            ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"),
            ("decode tok/s", "decode_tok_s", "{:.0f}"),
            ("output tok/s", "output_tok_s", "{:.0f}"),
            ("videos/GiB", "videos_per_gib", "{:.2f}"),
            ("preempt", "preemptions", "{:d}"),
        ]
        ratio_keys = ["prefill_tokens_computed", "ttft_ms_p50", "ttft_ms_p99", "decode_tok_s", "output_tok_s"]
        lines = [" | ".join(["run"] + [c[0] for c in cols])]
        for e in ok:
            cells = [e["name"]]
            for _, key, fmt in cols:
                v = e.get(key)
                cells.append("-" if v is None else fmt.format(v))
            lines.append(" | ".join(cells))
        lines.append("")
        lines.append(" | ".join([f"x {base['name']}"] + ratio_keys + ["videos/GiB vs " + ALL_RUNS["fp16-prefix"]]))
        fp16 = next((e for e in ok if e["run"] == "fp16-prefix"), None)
        for e in ok:
            cells = [e["name"]]
            for key in ratio_keys:
                b, v = base.get(key), e.get(key)
                cells.append(f"{v / b:.2f}x" if b and v is not None else "-")
            f = fp16.get("videos_per_gib") if fp16 else None
            v = e.get("videos_per_gib")
            cells.append(f"{v / f:.2f}x" if f and v is not None else "-")
            lines.append(" | ".join(cells))
        return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    bench = Bench(args)
    bench.setup()
    bench.runs()
    bench.result["meta"]["seconds"] = time.time() - bench.t0
    table = bench.table()
    bench.result["table"] = table
    bench.dump()
    print(table)
    bench.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
