"""Tensor-parallel decoding through mixkv: a Llama-shaped model with random
weights (tp_model.py) split over tp ranks, every rank's KV heads in its own
mixkv cache, one scheduler's decisions on every rank (mixkv.tp.TPEngine).

    python examples/tp/run.py --tp 2                               # CPU, gloo, FP16 plan, compared with tp = 1
    python examples/tp/run.py --tp 2 --plan mixed --arena-mib 2    # WindowQuant plans, memory pressure
    python examples/tp/run.py --tp 2 --backend cuda --dist-backend nccl --bench results.json   # two GPUs

The workload is video-QA shaped: (system text, frames of visual tokens,
question), requests arriving one a step. ``--plan``: fp16 (no plan), int4
or int2 (every visual window but the first at that precision), mixed
(WindowQuant: rank 0 plans each request from its prompt's embeddings,
planning_embeddings()). ``--compare`` (on unless --bench) also runs tp = 1 in this process
and prints how far the tp run's logits are from it. ``--bench OUT.json``
writes tokens/s, KV capacity and the step-time overhead of the engine's
messages for this tp (docs/tensor-parallel.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import mixkv  # noqa: E402
from launch import launch  # noqa: E402
from tp_model import LLAMA8B_SHAPE, SMALL, ModelConfig, TPLlama  # noqa: E402

PLANS = ("fp16", "int4", "int2", "mixed")
TOKENS_PER_FRAME = 64


@dataclass(frozen=True)
class Options:
    """One run: the model, the cache (arena_mib is each rank's), the
    workload, and the events and faults tests inject."""

    model: ModelConfig = SMALL
    backend: str = "cpu"
    weight_dtype: str = "float32"  # the matrix products' dtype: float32, or float16 (the GPU benchmark)
    plan: str = "fp16"
    block_size: int = 32
    arena_mib: float = 8.0
    slab_kib: int = 128
    swap_blocks: int = 0
    preemption: str = "recompute"
    requests: int = 4
    frames: int = 2
    system_tokens: int = 12
    question_tokens: int = 8
    new_tokens: int = 8
    arrival_gap: int = 1
    max_num_seqs: int = 8
    step_tokens: int = 128
    seed: int = 0
    check: bool = True
    check_state_every: int = 1
    # (step, request index): rank 0 forks request i into "<i>/fork" at that step, or the first step after it
    # where the request is running; cancels request i at that step when it is live.
    forks: tuple = ()
    cancels: tuple = ()
    # Tests' faults: (rank, step, kind), kind "model" (the rank raises in its model code), "step" (its
    # Engine.step raises), "diverge" (it cancels request 0 on its own engine, behind rank 0's back).
    fault: Optional[tuple] = None
    bench: bool = False

    def validate(self) -> None:
        if self.plan not in PLANS:
            raise ValueError(f"Options.plan = {self.plan!r}: expected one of {PLANS}")
        if self.backend not in ("cpu", "cuda"):
            raise ValueError(f"Options.backend = {self.backend!r}: expected 'cpu' or 'cuda'")
        if self.weight_dtype not in ("float32", "float16"):
            raise ValueError(f"Options.weight_dtype = {self.weight_dtype!r}: expected 'float32' or 'float16'")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"Options.preemption = {self.preemption!r}: expected 'recompute' or 'swap'")


@dataclass
class Request:
    id: str
    tokens: list  # the prompt's token ids
    layout: Any
    arrival_step: int
    max_new_tokens: int


@dataclass
class RunResult:
    """What one rank saw: every request's generated tokens and the logits
    each came from, the scheduler's counters, the final bookkeeping, and
    timings."""

    rank: int
    tp: int
    generated: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    describe_state: str = ""
    steps: int = 0
    digests: list = field(default_factory=list)  # Engine.step_digest() of every step
    peak_blocks: list = field(default_factory=lambda: [0, 0, 0])  # most blocks each pool held, [FP16, INT4, INT2]
    timings: dict = field(default_factory=dict)


def make_requests(options: Options) -> list:
    """The workload (seeded): token ids of the system text, the frames'
    visual tokens and the question."""
    rng = np.random.default_rng(options.seed)
    vocab = options.model.vocab
    requests = []
    for i in range(options.requests):
        system = rng.integers(0, vocab, options.system_tokens).tolist()
        question = rng.integers(0, vocab, options.question_tokens).tolist()
        visual = rng.integers(0, vocab, options.frames * TOKENS_PER_FRAME).tolist()
        layout = mixkv.TokenLayout(
            [
                mixkv.Segment(mixkv.TokenKind.Text, len(system)),
                mixkv.Segment(mixkv.TokenKind.Visual, len(visual)),
                mixkv.Segment(mixkv.TokenKind.Text, len(question)),
            ]
        )
        requests.append(
            Request(str(i), system + visual + question, layout, i * options.arrival_gap, options.new_tokens)
        )
    return requests


def planning_embeddings(options: Options, model: TPLlama, request: Request) -> np.ndarray:
    """What the WindowQuant planner reads for the mixed plan (rank 0 only):
    the text's input embeddings, and for the visual rows what a vision
    encoder would give, its frames leaning towards the question by 8, 2
    and 0 units (in a seeded order). A common direction in every row stands
    in for a trained embedding space, where cosines are not all ~0."""
    rng = np.random.default_rng(options.seed * 7919 + int(request.id))
    hidden = options.model.hidden
    common = rng.standard_normal(hidden).astype(np.float32) * 1.5
    text = model.embeddings(request.tokens) + common
    system, question = text[: options.system_tokens], text[-options.question_tokens :]
    topic = question.mean(0)
    topic *= np.sqrt(hidden) / np.linalg.norm(topic)
    visual = rng.standard_normal((options.frames * TOKENS_PER_FRAME, hidden)).astype(np.float32) + common
    leanings = rng.permutation([8.0, 2.0] + [0.0] * max(0, options.frames - 2))[: options.frames]
    for frame, leaning in enumerate(leanings):
        visual[frame * TOKENS_PER_FRAME : (frame + 1) * TOKENS_PER_FRAME] += leaning * topic
    return np.concatenate([system, visual, question]).astype(np.float32)


def fixed_plan(options: Options, layout: Any) -> Optional[Any]:
    """int4 / int2: every window but the first (WindowQuant keeps window 0,
    the attention sink, FP16) at that precision; fp16 and mixed: None."""
    if options.plan not in ("int4", "int2"):
        return None
    fill = mixkv.Precision.INT4 if options.plan == "int4" else mixkv.Precision.INT2
    windows = layout.num_windows(options.block_size)
    plan = mixkv.PrecisionPlan(options.model.num_layers, windows, fill)
    for layer in range(options.model.num_layers):
        if windows:
            plan.set(layer, 0, mixkv.Precision.FP16)
    return plan


def engine_args(options: Options) -> tuple:
    """The whole model's cache config (arena per rank), the scheduler config
    and the planner config, as TPEngine and mixkv.Engine take them."""
    m = options.model
    shape = mixkv.CacheShape(m.num_layers, m.num_kv_heads, m.head_dim, options.block_size)
    cache = mixkv.CacheConfig(
        shape, int(options.arena_mib * (1 << 20)), options.slab_kib << 10, swap_blocks=[options.swap_blocks] * 3
    )
    scheduler = mixkv.SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.step_tokens,
        preemption=mixkv.PreemptionMode.Swap if options.preemption == "swap" else mixkv.PreemptionMode.Recompute,
    )
    planner = None
    if options.plan == "mixed":
        # Layer sensitivities from 0.9 down to 0.6 (eq. 9): later layers keep more FP16, so the plans mix all
        # three precisions.
        sensitivities = np.linspace(0.9, 0.6, m.num_layers).tolist()
        planner = mixkv.PlannerConfig(sensitivities, window_size=options.block_size)
    return cache, scheduler, planner


def shard_config(cache: Any, tp: int) -> Any:
    """The cache of one rank (mixkv.tp.shard_cache_config; tp = 1: the cache)."""
    import mixkv.tp

    return mixkv.tp.shard_cache_config(cache, tp)


def serve(engine: Any, model: TPLlama, options: Options, rank: int = 0, tp: int = 1) -> RunResult:
    """The serving loop, the same code on every rank. ``engine`` is a
    mixkv.tp.TPEngine, or a mixkv.Engine for tp = 1. Rank 0 adds the
    requests as they arrive, forks and cancels; its step payload carries the
    new prompts' token ids (the other ranks never see the requests) and the
    forks, so every rank can build its rows; every rank samples (the logits
    are equal everywhere) and checks its tokens against rank 0's."""
    distributed = hasattr(engine, "payload")
    local = engine.engine if distributed else engine  # this rank's mixkv.Engine
    leader = rank == 0
    device = model.device
    result = RunResult(rank, tp)
    pending = make_requests(options) if leader else []
    tokens: dict = {}  # request id -> prompt + generated token ids
    sampled: dict = {}  # rank 0: the tokens of the last step, sent with the next one
    fork_plan = sorted(options.forks)
    cancel_plan = sorted(options.cancels)
    step_index = 0
    times = {"step": 0.0, "control": 0.0, "model": 0.0, "decode_rows": 0, "prefill_rows": 0}
    wall = time.perf_counter()
    while True:
        new: dict = {}
        forks: list = []
        if leader:
            # Arrivals due now; when nothing is live, the next one at once (no idle steps).
            while pending and (pending[0].arrival_step <= step_index or not local.has_unfinished()):
                r = pending.pop(0)
                plan = fixed_plan(options, r.layout)
                embeddings = planning_embeddings(options, model, r) if options.plan == "mixed" else None
                engine.add_request(
                    r.id,
                    r.layout,
                    plan=plan,
                    embeddings=embeddings,
                    max_new_tokens=r.max_new_tokens,
                    arrival_time=float(step_index),
                )
                new[r.id] = r.tokens
                tokens[r.id] = list(r.tokens)
            while fork_plan and fork_plan[0][0] <= step_index:
                parent = str(fork_plan[0][1])
                if parent not in local:
                    fork_plan.pop(0)  # it has left: no fork
                    continue
                status = local.status(parent)
                if status.state != mixkv.RequestState.Running or status.plan_pending:
                    break  # try again next step
                child = f"{parent}/fork"
                engine.fork(parent, child)
                tokens[child] = list(tokens[parent])
                forks.append((parent, child))
                fork_plan.pop(0)
            while cancel_plan and cancel_plan[0][0] <= step_index:
                victim = str(cancel_plan.pop(0)[1])
                if victim in local:
                    engine.cancel(victim)
        if not engine.has_unfinished():
            break
        step_index += 1
        if options.fault is not None and options.fault[0] == rank and options.fault[1] == step_index:
            inject(engine, options.fault[2], step_index)
        start = time.perf_counter()
        if distributed:
            step = engine.step(payload=(new, forks, sampled) if leader else None)
            times["control"] += engine.step_seconds[0]
            if not leader:
                new, forks, theirs = engine.payload
                for rid, token in theirs.items():
                    if result.generated[rid][-1] != token:
                        raise RuntimeError(
                            f"rank {rank}: step {step_index - 1}: sampled {result.generated[rid][-1]} for request "
                            f"{rid!r}, rank 0 sampled {token}: the ranks' logits differ"
                        )
                for rid, prompt in new.items():
                    tokens[rid] = list(prompt)
                for parent, child in forks:
                    tokens[child] = list(tokens[parent])
        else:
            step = engine.step()
        times["step"] += time.perf_counter() - start
        result.digests.append(local.step_digest())
        for p in mixkv.Precision:
            result.peak_blocks[p] = max(result.peak_blocks[p], local.cache.pool_stats(p).used_blocks)
        sampled = {}

        start = time.perf_counter()
        prefill_ids, prefill_pos, sample_rows, sample_ids = [], [], [], []
        for chunk in step.prefills:
            prefill_ids += tokens[chunk.request_id][chunk.start : chunk.end]
            prefill_pos += list(range(chunk.start, chunk.end))
            if chunk.last:  # the prompt is complete: its last row gives the next token
                sample_rows.append(len(prefill_ids) - 1)
                sample_ids.append(chunk.request_id)
        decode_ids = [tokens[rid][-1] for rid in step.decodes]
        decode_pos = [len(tokens[rid]) - 1 for rid in step.decodes]
        sample_rows += [len(prefill_ids) + i for i in range(len(step.decodes))]
        sample_ids += list(step.decodes)
        if prefill_ids or decode_ids:
            h = model.forward(
                engine,
                torch.tensor(prefill_ids, dtype=torch.int64),
                torch.tensor(prefill_pos, dtype=torch.int64),
                torch.tensor(decode_ids, dtype=torch.int64),
                torch.tensor(decode_pos, dtype=torch.int64),
            )
            logits = model.logits(h[torch.tensor(sample_rows, dtype=torch.int64, device=device)])
            chosen = logits.argmax(-1).tolist()
            keep = logits.cpu().numpy() if not options.bench else None
            for i, (rid, token) in enumerate(zip(sample_ids, chosen)):
                tokens[rid].append(token)
                result.generated.setdefault(rid, []).append(token)
                if keep is not None:
                    result.logits.setdefault(rid, []).append(keep[i])
                sampled[rid] = token
        if options.backend == "cuda":
            torch.cuda.synchronize(device)
        times["model"] += time.perf_counter() - start
        times["decode_rows"] += len(decode_ids)
        times["prefill_rows"] += len(prefill_ids)
    times["wall"] = time.perf_counter() - wall
    times["comm"] = model.comm_seconds
    if distributed:
        engine.verify_identical()
    engine.check_invariants()
    s = engine.stats()
    result.stats = {
        name: getattr(s, name)
        for name in (
            "steps",
            "finished",
            "cancelled",
            "forks",
            "demotions",
            "plan_demotions",
            "preempted_recompute",
            "preempted_swap",
            "decode_tokens",
            "prefill_tokens",
        )
    }
    result.describe_state = engine.describe_state()
    result.steps = step_index
    result.timings = times
    result.logits = {rid: np.stack(rows) for rid, rows in result.logits.items()}
    return result


def inject(engine: Any, kind: str, step_index: int) -> None:
    """The tests' faults (Options.fault)."""
    if kind == "model":
        raise RuntimeError(f"injected fault in the model at step {step_index}")
    inner = engine.engine
    if kind == "step":

        def failing_step(**kwargs: Any) -> Any:
            raise RuntimeError(f"injected fault in Engine.step at step {step_index}")

        inner.step = failing_step
    elif kind == "diverge":
        live = [key for key in inner._ids]
        inner.cancel(live[0])  # behind rank 0's back: this rank's scheduler now differs
    else:
        raise ValueError(f"Options.fault: kind {kind!r}: expected 'model', 'step' or 'diverge'")


def run_single(options: Options, like_tp: int = 1) -> RunResult:
    """tp = 1 in this process, through mixkv.Engine (no torch.distributed).
    ``like_tp``: scale the arena and the slabs by it, so that the cache has
    the slabs and blocks per slab of one rank of a ``like_tp`` run (its
    blocks are like_tp times larger): then the scheduler takes the same
    decisions as that run's, block ids included."""
    options.validate()
    if like_tp > 1:
        options = replace(options, arena_mib=options.arena_mib * like_tp, slab_kib=options.slab_kib * like_tp)
    cache, scheduler, planner = engine_args(options)
    device = "cuda:0" if options.backend == "cuda" else "cpu"
    model = TPLlama(options.model, device=device, dtype=getattr(torch, options.weight_dtype))
    engine = mixkv.Engine(
        cache, scheduler, num_q_heads=options.model.num_heads, backend=options.backend, planner=planner
    )
    return serve(engine, model, options)


def run_rank(rank: int, tp: int, options: Options) -> RunResult:
    """One rank of a tp run (launch() calls it after init_process_group)."""
    import mixkv.tp

    options.validate()
    device = "cpu"
    if options.backend == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    cache, scheduler, planner = engine_args(options)
    model = TPLlama(
        options.model,
        rank,
        tp,
        device=device,
        dtype=getattr(torch, options.weight_dtype),
    )
    engine = mixkv.tp.TPEngine(
        cache,
        scheduler,
        num_q_heads=options.model.num_heads,
        backend=options.backend,
        planner=planner,
        device=rank if options.backend == "cuda" else 0,
        check=options.check,
        check_state_every=options.check_state_every,
    )
    return serve(engine, model, options, rank, tp)


def compare(reference: RunResult, run: RunResult) -> dict:
    """Tokens equal to the reference, and the largest logit difference
    relative to the logits' spread, over the tokens both generated before
    their first disagreement."""
    equal = total = 0
    worst = 0.0
    for rid, ref_tokens in reference.generated.items():
        mine = run.generated.get(rid, [])
        total += len(ref_tokens)
        agree = 0
        for a, b in zip(ref_tokens, mine):
            if a != b:
                break
            agree += 1
        equal += agree
        if agree and rid in reference.logits and rid in run.logits:
            ref = reference.logits[rid][: agree + 1 if agree < len(mine) else agree]
            got = run.logits[rid][: len(ref)]
            scale = float(np.abs(ref).max()) or 1.0
            worst = max(worst, float(np.abs(ref - got).max()) / scale)
    return {"tokens_equal": equal, "tokens": total, "max_logit_error": worst}


def capacity(options: Options, tp: int) -> dict:
    """Tokens one rank's arena holds at FP16 and at this run's plan, and
    bytes of one token (all layers) per rank."""
    cache, _, _ = engine_args(options)
    shard = shard_config(cache, tp)
    m = options.model
    per_token = {
        p.name: mixkv.bytes_per_token_per_head(p, m.head_dim, options.block_size)
        * shard.shape.num_kv_heads
        * m.num_layers
        for p in mixkv.Precision
    }
    return {
        "arena_bytes_per_rank": shard.arena_bytes,
        "kv_heads_per_rank": shard.shape.num_kv_heads,
        "bytes_per_token_per_rank": per_token,
        "tokens_at_fp16": int(shard.arena_bytes // per_token["FP16"]),
        "tokens_at_int4": int(shard.arena_bytes // per_token["INT4"]),
        "tokens_at_int2": int(shard.arena_bytes // per_token["INT2"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks (processes) of the tensor-parallel group")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="mixkv's backend on every rank")
    parser.add_argument("--dist-backend", choices=("gloo", "nccl"), default=None, help="default: nccl for cuda")
    parser.add_argument("--plan", choices=PLANS, default="fp16")
    parser.add_argument("--model", choices=("small", "llama8b-shape"), default="small")
    parser.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    parser.add_argument(
        "--weight-dtype", choices=("float32", "float16"), default=None, help="default: float16 for llama8b-shape"
    )
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--frames", type=int, default=2, help=f"frames of {TOKENS_PER_FRAME} visual tokens")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--arena-mib", type=float, default=8.0, help="KV memory of each rank")
    parser.add_argument("--step-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--swap-blocks", type=int, default=0, help="host swap blocks per pool")
    parser.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--no-check", action="store_true", help="skip the per-step digest comparison")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run tp = 1 here and compare (default: on unless --bench)",
    )
    parser.add_argument("--bench", metavar="OUT.json", default=None, help="write timings and capacity as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the tp run may take")
    args = parser.parse_args()
    dist_backend = args.dist_backend or ("nccl" if args.backend == "cuda" else "gloo")
    if dist_backend == "nccl" and args.backend != "cuda":
        parser.error("--dist-backend nccl: needs --backend cuda (the model's tensors must be on the GPUs)")
    if args.backend == "cuda":
        if not mixkv.built_with_cuda:
            parser.error("--backend cuda: mixkv was built without CUDA")
        if torch.cuda.device_count() < args.tp:
            parser.error(
                f"--backend cuda --tp {args.tp}: needs {args.tp} CUDA GPUs, {torch.cuda.device_count()} visible"
            )
    model = SMALL if args.model == "small" else LLAMA8B_SHAPE
    if args.layers is not None:
        model = replace(model, num_layers=args.layers)
    options = Options(
        model=model,
        backend=args.backend,
        weight_dtype=args.weight_dtype or ("float16" if args.model == "llama8b-shape" else "float32"),
        plan=args.plan,
        arena_mib=args.arena_mib,
        requests=args.requests,
        frames=args.frames,
        new_tokens=args.new_tokens,
        step_tokens=args.step_tokens,
        max_num_seqs=args.max_num_seqs,
        swap_blocks=args.swap_blocks,
        preemption=args.preemption,
        check=not args.no_check,
        check_state_every=0 if args.bench else 1,
        bench=args.bench is not None,
    )
    try:
        model.validate(args.tp)
        options.validate()
    except ValueError as error:
        parser.error(str(error))
    print(
        f"mixkv tp: {args.tp} ranks over {dist_backend}, {args.backend} backend, plan {args.plan}, "
        f"{options.requests} requests of {make_requests(options)[0].layout.num_tokens} prompt tokens, "
        f"{options.new_tokens} new tokens each, {options.arena_mib} MiB of KV memory a rank"
    )
    start = time.perf_counter()
    results = launch(run_rank, args.tp, options, timeout=args.timeout, dist_backend=dist_backend)
    elapsed = time.perf_counter() - start
    for r in results:
        if r.status != "ok":
            print(f"rank {r.rank}: {r.status}: {r.error}", file=sys.stderr)
            if r.trace:
                print(r.trace, file=sys.stderr)
    if any(r.status != "ok" for r in results):
        sys.exit(1)
    run = results[0].value
    same = all(r.value.describe_state == run.describe_state for r in results)
    print(f"  {run.steps} steps in {elapsed:.1f} s (start-up included); scheduler: {run.stats}")
    print(f"  every rank's describe_state() equal: {same}")
    t = run.timings
    print(
        f"  rank 0: step() {t['step']:.3f} s (of which the engine's messages {t['control']:.3f} s), "
        f"model {t['model']:.3f} s (all-reduce {t['comm']:.3f} s), {t['decode_rows']} decode rows"
    )
    report: dict = {
        "tp": args.tp,
        "backend": args.backend,
        "dist_backend": dist_backend,
        "plan": args.plan,
        "options": {k: v for k, v in asdict(options).items() if k != "model"},
        "model": asdict(model),
        "capacity": capacity(options, args.tp),
        "timings": t,
        "steps": run.steps,
        "stats": run.stats,
        "ranks_identical": same,
    }
    generated = sum(len(tokens) for tokens in run.generated.values())
    report["generated_tokens"] = generated
    report["generated_tokens_per_s"] = generated / t["wall"] if t["wall"] > 0 else 0.0
    report["step_ms"] = 1e3 * t["step"] / max(run.steps, 1)
    report["control_ms_per_step"] = 1e3 * t["control"] / max(run.steps, 1)
    report["control_fraction_of_wall"] = t["control"] / t["wall"] if t["wall"] > 0 else 0.0
    report["peak_blocks_rank0"] = run.peak_blocks
    do_compare = args.compare if args.compare is not None else args.bench is None
    if do_compare:
        # tp = 1 with the slabs and blocks per slab of one rank here: the same decisions, step by step.
        reference = run_single(options, like_tp=args.tp)
        c = compare(reference, run)
        c["step_digests_equal"] = reference.digests == run.digests
        report["compare"] = c
        print(
            f"  against tp = 1: {c['tokens_equal']}/{c['tokens']} tokens equal, largest logit difference "
            f"{c['max_logit_error']:.2e} of the largest logit, step digests equal: {c['step_digests_equal']}"
        )
    if args.bench:
        with open(args.bench, "w") as out:
            json.dump(report, out, indent=2, default=str)
        print(f"  wrote {args.bench}")


if __name__ == "__main__":
    main()
