"""A decode loop of a small Llama-style transformer whose KV cache is mixkv.

The model has random weights (RMSNorm, RoPE, GQA attention, SwiGLU); the
requests are video-QA shaped: (system text, frames of visual tokens, question).
mixkv.Scheduler batches them continuously (requests arrive while others
decode, prompts are prefilled in chunks); the WindowQuant planner inside the
scheduler stores each 32-token visual window at FP16, INT4 or INT2 by its
similarity to the text; decode attention reads the three pools. The same
workload then runs with an all-FP16 cache, and the closing table compares the
two: memory per pool, tokens/s, and how often the generated tokens agree.

    python examples/llama_decode.py [--requests 6] [--frames 4] [--new-tokens 24] [--backend auto]
                                    [--prefill-mode exact|compact] [--step-tokens 128]

mixkv.Engine holds the cache and applies each step's memory moves (demotions,
swaps, copy-on-write copies, page tables); the loop below only runs the model
and hands the engine each layer's K/V/Q. Backends: `cpu`, the engine's CPU
backend (NumPy arrays in and out); `cuda`, its CUDA backend (the model stays
in NumPy on the host; each layer's q/k/v go to the GPU as torch tensors);
`auto` picks `cuda` where mixkv was built with CUDA and torch sees a GPU.
Attention outputs are float16 on both.

Prefill goes through the cache too (Engine.prefill): a chunk's rows attend
to the prompt rows that earlier chunks stored and causally to each other, and
the engine keeps no copy of the prompt. The prefill mode says what earlier
chunks are read as: `exact` (the default) holds a chunked prompt FP16 until
its last chunk and then demotes it to its plan, so the prefill equals dense
prefill; `compact` stores each window at its plan as its chunk completes,
so later chunks read earlier windows quantized, and a prompt never takes
its FP16 size in the cache.
"""

import argparse
import math
import sys
import time

import mixkv
import numpy as np

VOCAB = 512
HIDDEN = 512
LAYERS = 4
Q_HEADS = 8
KV_HEADS = 2
HEAD_DIM = 64
FFN = 1024
WINDOW = 32
TOKENS_PER_FRAME = 64


class Model:
    """Llama-style decoder with random weights, in float32 with float16 K/V."""

    def __init__(self, rng):
        def w(*shape):
            return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)

        self.embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        self.layers = [
            dict(
                wq=w(HIDDEN, Q_HEADS * HEAD_DIM),
                wk=w(HIDDEN, KV_HEADS * HEAD_DIM),
                wv=w(HIDDEN, KV_HEADS * HEAD_DIM),
                wo=w(Q_HEADS * HEAD_DIM, HIDDEN),
                w1=w(HIDDEN, FFN),
                w3=w(HIDDEN, FFN),
                w2=w(FFN, HIDDEN),
            )
            for _ in range(LAYERS)
        ]
        self.unembed = w(HIDDEN, VOCAB)
        inv = 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.inv_freq = inv.astype(np.float32)

    @staticmethod
    def norm(x):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    def rope(self, x, positions):  # x [rows, heads, dim]
        angles = positions[:, None].astype(np.float32) * self.inv_freq[None]
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def qkv(self, layer, h, positions):
        p = self.layers[layer]
        x = self.norm(h)
        q = self.rope((x @ p["wq"]).reshape(-1, Q_HEADS, HEAD_DIM), positions)
        k = self.rope((x @ p["wk"]).reshape(-1, KV_HEADS, HEAD_DIM), positions)
        v = (x @ p["wv"]).reshape(-1, KV_HEADS, HEAD_DIM)
        return q, k.astype(np.float16), v.astype(np.float16)

    def finish_layer(self, layer, h, attn):  # attn [rows, Q_HEADS, HEAD_DIM]
        p = self.layers[layer]
        h = h + attn.reshape(len(h), -1) @ p["wo"]
        x = self.norm(h)
        gate = x @ p["w1"]
        return h + ((gate / (1 + np.exp(-gate))) * (x @ p["w3"])) @ p["w2"]

    def logits(self, h):
        return self.norm(h) @ self.unembed


def causal_attention(q, k, v, first_position):
    """Dense attention of rows first_position.. over keys 0..: q [rows, Hq, D], k/v [keys, Hkv, D]. For the
    calibration pass only: the serving loop's prefill attention is mixkv's (Engine.prefill)."""
    group = Q_HEADS // KV_HEADS
    k = np.repeat(k.astype(np.float32), group, axis=1)
    v = np.repeat(v.astype(np.float32), group, axis=1)
    scores = np.einsum("rhd,khd->hrk", q, k) / math.sqrt(HEAD_DIM)
    rows = np.arange(len(q))[:, None] + first_position
    scores = np.where(np.arange(len(k))[None, :] <= rows, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hrk,khd->rhd", p / p.sum(-1, keepdims=True), v)


def make_requests(rng, model, count, frames, new_tokens):
    """Video-QA prompts: the question is about one frame, whose visual tokens lean towards it. All
    embeddings share one direction, as trained embedding spaces do, so that cosines are not all ~0."""
    common = rng.standard_normal(HIDDEN).astype(np.float32) * 1.5
    model.embed += common
    requests = []
    for i in range(count):
        system = rng.integers(0, VOCAB, 16)
        question = rng.integers(0, VOCAB, 12)
        topic = model.embed[question].mean(0)
        visual = rng.standard_normal((frames * TOKENS_PER_FRAME, HIDDEN)).astype(np.float32) + common
        relevant = int(rng.integers(0, frames))
        rows = slice(relevant * TOKENS_PER_FRAME, (relevant + 1) * TOKENS_PER_FRAME)
        visual[rows] += 3.0 * topic / np.linalg.norm(topic) * math.sqrt(HIDDEN)
        embeddings = np.concatenate([model.embed[system], visual, model.embed[question]]).astype(np.float32)
        layout = mixkv.TokenLayout(
            [
                mixkv.Segment(mixkv.TokenKind.Text, len(system)),
                mixkv.Segment(mixkv.TokenKind.Visual, len(visual)),
                mixkv.Segment(mixkv.TokenKind.Text, len(question)),
            ]
        )
        requests.append(dict(id=i, layout=layout, embeddings=embeddings, max_new_tokens=new_tokens, arrival_step=2 * i))
    return requests


def measure_sensitivities(model, request):
    """Eq. 9 per layer on one calibration prompt: hidden states before and after attention."""
    h = request["embeddings"]
    positions = np.arange(len(h))
    before, after = [], []
    for layer in range(LAYERS):
        q, k, v = model.qkv(layer, h, positions)
        attn = causal_attention(q, k, v, 0)
        before.append(h.copy())
        after.append(h + attn.reshape(len(h), -1) @ model.layers[layer]["wo"])
        h = model.finish_layer(layer, h, attn)
    return mixkv.layer_sensitivity(before, after)


class Progress:
    def __init__(self, total):
        self.total, self.done = total, 0

    def update(self, done, note):
        self.done = done
        if not sys.stderr.isatty() and done < self.total:
            return  # a log gets the final line only
        filled = int(30 * done / max(self.total, 1))
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} tokens  {note}   ")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")


def pick_backend(name):
    """'auto': CUDA where mixkv was built with it and torch sees a GPU."""
    if name in ("auto", "cuda") and mixkv.built_with_cuda:
        try:
            import mixkv.cuda as mc
            import torch

            if mc.device_available() and torch.cuda.is_available():
                return "cuda"
        except ImportError:
            pass
    if name == "cuda":
        raise SystemExit("--backend cuda: needs mixkv built with CUDA, torch and a visible GPU")
    return "cpu"


def array_io(backend):
    """How the NumPy model's arrays reach the engine and come back: as they are on the CPU backend, as torch
    CUDA tensors on the CUDA one (attention outputs are float16 on both)."""
    if backend == "cuda":
        import torch

        return (lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda(), lambda t: t.float().cpu().numpy())
    return (lambda a: a), (lambda a: a.astype(np.float32))


def serve(
    model,
    requests,
    sensitivities,
    fp16_only,
    arena_bytes,
    backend="cpu",
    swap_blocks=0,
    preemption=mixkv.PreemptionMode.Recompute,
    forced=None,
    prefill_mode=mixkv.PrefillMode.Exact,
    step_tokens=128,
):
    """Runs the workload through a mixkv.Engine on one backend; returns the generated tokens, the logits each
    came from, peak pool usage, scheduler counters and timings. `forced` (id -> tokens) feeds those tokens
    instead of the argmax, so that two runs see the same sequences and their logits can be compared.
    `prefill_mode`: mixkv.PrefillMode.Exact or Compact (what a chunk reads of the chunks before it);
    `step_tokens`: the rows a step computes at most (prompt chunks and decodes), so longer prompts are chunked."""
    shape = mixkv.CacheShape(LAYERS, KV_HEADS, HEAD_DIM, WINDOW)
    config = mixkv.CacheConfig(
        shape, arena_bytes, slab_bytes=256 << 10, swap_blocks=[swap_blocks] * 3, fp16_windows_first=True
    )
    planner = mixkv.PlannerConfig(
        sensitivities, window_size=WINDOW, min_precision=[mixkv.Precision.FP16] * LAYERS if fp16_only else []
    )
    engine = mixkv.Engine(
        config,
        mixkv.SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=step_tokens, preemption=preemption, prefill_mode=prefill_mode
        ),
        num_q_heads=Q_HEADS,
        backend=backend,
        planner=planner,
    )
    to_engine, from_engine = array_io(backend)
    by_id = {r["id"]: r for r in requests}
    generated = {r["id"]: [] for r in requests}
    logits_of = {r["id"]: [] for r in requests}
    peak = [0, 0, 0]
    peak_bytes = 0
    block_bytes = [engine.cache.format(p).block_bytes for p in mixkv.Precision]
    total = sum(r["max_new_tokens"] for r in requests)
    progress = Progress(total)
    decode_time = prefill_time = 0.0
    decode_tokens = 0
    pending = sorted(requests, key=lambda r: r["arrival_step"])

    def sample(rid, logits):
        logits_of[rid].append(logits)
        n = len(generated[rid])
        generated[rid].append(int(forced[rid][n]) if forced is not None else int(np.argmax(logits)))

    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0]["arrival_step"] <= step:
            r = pending.pop(0)
            engine.add_request(
                r["id"], r["layout"], embeddings=r["embeddings"], max_new_tokens=r["max_new_tokens"], arrival_time=step
            )
        step += 1
        out = engine.step()  # the scheduler's decisions, their memory moves already applied

        # Prefill chunks, layer by layer, every chunk's rows in one call: Engine.prefill attends each chunk's
        # rows to the rows its request stored before (read through the cache) and causally to each other, then
        # stores the chunk's K/V. A recomputed prompt is the original prompt plus the generated tokens.
        start = time.perf_counter()
        if out.prefills:
            rows, positions = [], []
            for chunk in out.prefills:
                r = by_id[chunk.request_id]
                prompt = np.concatenate([r["embeddings"], model.embed[generated[chunk.request_id]]])
                rows.append(prompt[chunk.start : chunk.end])
                positions.append(np.arange(chunk.start, chunk.end))
            h, positions = np.concatenate(rows), np.concatenate(positions)
            for layer in range(LAYERS):
                q, k, v = model.qkv(layer, h, positions)
                attn = engine.prefill(layer, to_engine(q.astype(np.float16)), to_engine(k), to_engine(v))
                h = model.finish_layer(layer, h, from_engine(attn))
            last_rows = np.cumsum([chunk.end - chunk.start for chunk in out.prefills]) - 1
            for chunk, row in zip(out.prefills, last_rows):
                if chunk.last:  # the prompt is complete: its last row gives the first token
                    sample(chunk.request_id, model.logits(h[row]))
        prefill_time += time.perf_counter() - start

        # The decode batch: per layer, the engine appends the K/V and attends over the three pools.
        start = time.perf_counter()
        if out.decodes:
            ids = list(out.decodes)
            tokens = np.array([generated[i][-1] for i in ids])
            positions = np.array([by_id[i]["layout"].num_tokens + len(generated[i]) - 1 for i in ids])
            h = model.embed[tokens]
            for layer in range(LAYERS):
                q, k, v = model.qkv(layer, h, positions)
                attn = engine.attend(layer, to_engine(q.astype(np.float16)), to_engine(k), to_engine(v))
                h = model.finish_layer(layer, h, from_engine(attn))
            for i, logits in zip(ids, model.logits(h)):
                sample(i, logits)
            decode_tokens += len(ids)
        decode_time += time.perf_counter() - start

        for p in mixkv.Precision:
            peak[p] = max(peak[p], engine.cache.pool_stats(p).used_blocks)
        used = sum(engine.cache.pool_stats(p).used_blocks * block_bytes[p] for p in mixkv.Precision)
        peak_bytes = max(peak_bytes, used)
        stats = engine.stats()
        progress.update(
            sum(len(g) for g in generated.values()),
            f"step {step}: running {stats.running}, prefilling {stats.prefilling}, "
            f"waiting {stats.waiting}, demotions {stats.demotions}",
        )
    progress.close()
    engine.check_invariants()
    stats = engine.stats()
    return dict(
        generated=generated,
        logits=logits_of,
        peak=peak,
        peak_bytes=peak_bytes,
        block_bytes=block_bytes,
        decode_time=decode_time,
        prefill_time=prefill_time,
        decode_tokens=decode_tokens,
        prefill_tokens=stats.prefill_tokens,
        demotions=stats.demotions,
        plan_demotions=stats.plan_demotions,
        preempted_recompute=stats.preempted_recompute,
        preempted_swap=stats.preempted_swap,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--frames", type=int, default=4, help=f"frames of {TOKENS_PER_FRAME} visual tokens")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--arena-mib", type=int, default=16)
    parser.add_argument("--swap-blocks", type=int, default=0, help="host swap blocks per pool")
    parser.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--prefill-mode",
        choices=("exact", "compact"),
        default="exact",
        help="exact: a chunked prompt is held FP16 until its last chunk, then demoted to its plan (prefill equals "
        "dense prefill); compact: each window is stored at its plan as its chunk completes (less memory)",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=128,
        help="rows a step computes at most (max_num_batched_tokens): longer prompts are prefilled in chunks",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sensitivity",
        default="0.85",
        help="layer sensitivity for the planner (eq. 9), or 'measured' to measure it on this model: "
        "random weights barely change the residual stream (eq. 9 ~ 0.97), which would put every "
        "window but the first in INT2; 0.85 stands in for a trained model's layers",
    )
    args = parser.parse_args()
    backend = pick_backend(args.backend)
    preemption = mixkv.PreemptionMode.Swap if args.preemption == "swap" else mixkv.PreemptionMode.Recompute
    prefill_mode = mixkv.PrefillMode.Exact if args.prefill_mode == "exact" else mixkv.PrefillMode.Compact

    rng = np.random.default_rng(args.seed)
    model = Model(rng)
    requests = make_requests(rng, model, args.requests, args.frames, args.new_tokens)
    measured = measure_sensitivities(model, requests[0])
    sensitivities = measured if args.sensitivity == "measured" else [float(args.sensitivity)] * LAYERS
    print(
        f"mixkv {mixkv.__version__}: {args.requests} requests of {requests[0]['layout'].num_tokens} prompt tokens, "
        f"{args.new_tokens} new tokens each; measured layer sensitivities {np.round(measured, 3).tolist()}, "
        f"planning with {np.round(sensitivities, 3).tolist()}; {backend} backend, {args.prefill_mode} prefill"
    )
    runs = {}
    for name, fp16_only in (("WindowQuant", False), ("FP16", True)):
        print(f"{name} cache:")
        runs[name] = serve(
            model,
            requests,
            sensitivities,
            fp16_only,
            args.arena_mib << 20,
            backend,
            args.swap_blocks,
            preemption,
            prefill_mode=prefill_mode,
            step_tokens=args.step_tokens,
        )

    wq, fp = runs["WindowQuant"], runs["FP16"]
    print()
    print(f"{'':24}{'WindowQuant':>14}{'FP16':>14}")
    for p in mixkv.Precision:
        cells = [f"{r['peak'][p]} x {r['block_bytes'][p] // 1024} KiB" for r in (wq, fp)]
        print(f"{'peak ' + p.name + ' blocks':24}{cells[0]:>14}{cells[1]:>14}")
    kib = [r["peak_bytes"] / 1024 for r in (wq, fp)]  # the largest total of one step
    print(f"{'peak KV memory (KiB)':24}{kib[0]:>14.0f}{kib[1]:>14.0f}")
    tps = [r["decode_tokens"] / r["decode_time"] for r in (wq, fp)]
    print(f"{'decode tokens/s':24}{tps[0]:>14.1f}{tps[1]:>14.1f}")
    ptps = [r["prefill_tokens"] / r["prefill_time"] for r in (wq, fp)]
    print(f"{'prefill tokens/s':24}{ptps[0]:>14.1f}{ptps[1]:>14.1f}")
    for key in ("demotions", "plan_demotions", "preempted_recompute", "preempted_swap"):
        print(f"{key.replace('_', ' '):24}{wq[key]:>14}{fp[key]:>14}")
    same = total = prefix = 0
    for rid, tokens in fp["generated"].items():
        mine = wq["generated"][rid]
        matches = [a == b for a, b in zip(mine, tokens)]
        same += sum(matches)
        total += len(tokens)
        prefix += next((i for i, m in enumerate(matches) if not m), len(matches))
    print(f"{'tokens equal to FP16':24}{f'{same}/{total}':>14}{'-':>14}")
    print(f"{'  until 1st divergence':24}{f'{prefix}/{total}':>14}{'-':>14}")
    attention = (
        "the CUDA kernels"
        if backend == "cuda"
        else "mixkv's CPU backend (float64 reference attention), not of the CUDA kernels"
    )
    held = (
        " (exact prefill holds a chunked prompt FP16 until its last chunk; --prefill-mode compact does not)"
        if wq["plan_demotions"]
        else ""
    )
    print(
        f"\nPeak KV memory {kib[1] / kib[0]:.2f}x smaller with WindowQuant{held}. Tokens/s are of this NumPy engine "
        f"(the model's matrices on the host) with attention on {attention}."
    )


if __name__ == "__main__":
    main()
