"""The decode variants served by one mixkv.Engine, and a plain dense cache
beside them as the reference.

Every variant is a request with its own plan. The engine's first step takes
every layer's prompt K/V from the dense prefill (Engine.store); each request
is then forked, so two requests share its prompt blocks, and every decode
step appends the batch's tokens and attends over every pool (Engine.attend),
all requests in one batch. summarize turns a variant's decode records into
its row of the table.
"""

# decode_all's per-step attention closure is called inside the loop iteration
# that makes it, so it may read that iteration's variables.
# ruff: noqa: B023

from __future__ import annotations

import mixkv
import numpy as np
from model import SmolLM2, log_softmax
from progress import tqdm
from task import Prompt


def make_engine(model: SmolLM2, config, prompt: Prompt, sequences: int, backend: str = "cpu"):
    """A mixkv.Engine over `config` for `sequences` requests of this prompt,
    half of them forks. The token budget holds every prompt at once, so one
    step prefills them all and the variants decode in lockstep from the
    next. Demotion is off: each variant is measured under its own plan, and
    the cache is sized to hold them all (cache_config)."""
    scheduler = mixkv.SchedulerConfig(
        max_num_seqs=sequences,
        max_num_batched_tokens=sequences * len(prompt.ids) + sequences,
        demote_under_pressure=False,
    )
    return mixkv.Engine(config, scheduler, num_q_heads=model.config.num_heads, backend=backend)


def to_engine(engine, a: np.ndarray):
    """A NumPy array as the engine's backend takes it: the array itself on
    the CPU, a torch tensor on the engine's GPU (the model stays in NumPy)."""
    a = np.ascontiguousarray(a)
    if engine.backend == "cuda":
        import torch

        return torch.from_numpy(a).to(f"cuda:{engine.device}")
    return a


def from_engine(a) -> np.ndarray:
    """Engine.attend's float16 output as a NumPy float32 array."""
    if isinstance(a, np.ndarray):
        return a.astype(np.float32)
    return a.float().cpu().numpy()


def pick_backend(name: str):
    """'auto': CUDA when mixkv was built with it and a GPU is visible."""
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


class DenseCache:
    """The plain reference: K/V of one sequence as NumPy float16 arrays,
    attention in float32."""

    def __init__(self, ks, vs, config):
        self.k = [k.copy() for k in ks]
        self.v = [v.copy() for v in vs]
        self.c = config

    def attend(self, layer, q, k, v):
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        c = self.c
        group = c.num_heads // c.num_kv_heads
        kk = self.k[layer].astype(np.float32)
        vv = self.v[layer].astype(np.float32)
        out = np.empty((c.num_heads, c.head_dim), dtype=np.float32)
        for h in range(c.num_heads):
            s = kk[:, h // group, :] @ q[h] / np.sqrt(c.head_dim)
            p = np.exp(s - s.max())
            out[h] = (p @ vv[:, h // group, :]) / p.sum()
        return out


def prefill_engine(engine, prompt: Prompt, plans, ks, vs, max_new_tokens: int):
    """Adds one request per plan to `engine` (a mixkv.Engine; request id
    "cont:<plan name>", stored under that plan, up to `max_new_tokens`
    tokens, the first one sampled from the prefill) and stores the dense
    prefill's K/V as the step's prefill rows, every layer; then forks each
    into "path:<plan name>", which shares its prompt blocks. The first output
    token comes from the dense prefill, so nothing is sampled here."""
    for name, plan in plans.items():
        engine.add_request(f"cont:{name}", prompt.layout, plan=plan, max_new_tokens=max_new_tokens)
    step = engine.step()
    done = {p.request_id for p in step.prefills if p.last}
    if step.rejected or step.decodes or done != {f"cont:{name}" for name in plans}:
        raise RuntimeError(f"the engine did not prefill every request in one step: {step}")
    for layer, (k, v) in enumerate(zip(ks, vs)):
        engine.store(
            layer,
            to_engine(engine, np.concatenate([k[p.start : p.end] for p in step.prefills])),
            to_engine(engine, np.concatenate([v[p.start : p.end] for p in step.prefills])),
        )
    for name in plans:
        engine.fork(f"cont:{name}", f"path:{name}")


def decode_all(model, engine, prompt, first_logits, plans, ks, vs, dense: DenseCache, max_new: int, progress=True):
    """Decodes every variant through `engine` (a mixkv.Engine, empty) in
    lockstep, one batch per step. Per variant two requests share the stored
    prompt (prefill_engine): 'cont' is teacher-forced on the reference
    answer, 'path' on FP16's free-running greedy answer (the FP16 variant's
    own 'path' is that free-running answer). A request is finished once its
    stream ends, since the engine decodes every running request each step.
    The dense reference decodes greedily on its own. Returns (per-variant
    records, FP16's greedy tokens, the dense tokens, the largest logit gap
    between them while their inputs agree)."""
    variants = list(plans)
    eos = model.eos_id
    answer = prompt.answer
    n0 = len(prompt.ids)
    first = int(np.argmax(first_logits))
    greedy_fp16 = [first]
    dense_tokens = [first]
    rec = {
        v: {"cont_logp": [float(log_softmax(first_logits)[answer[0]])], "cont_argmax": [first], "path_argmax": [first]}
        for v in variants
    }
    cont_steps = len(answer) - 1
    path_done = first == eos or len(greedy_fp16) >= max_new
    dense_done = first == eos or len(dense_tokens) >= max_new
    # One more token than either stream decodes: a request ends by finish()
    # when its stream does, never by the scheduler's length limit.
    prefill_engine(engine, prompt, plans, ks, vs, max(cont_steps, max_new - 1) + 2)

    def finish(kind):
        for v in variants:
            engine.finish(f"{kind}:{v}")

    if cont_steps == 0:
        finish("cont")
    if path_done:
        finish("path")
    max_logit_gap = 0.0
    bar = tqdm(total=max(cont_steps, max_new - 1), desc="decode (mixkv)", disable=not progress)
    t = 0
    while t < cont_steps or (not path_done and t < max_new - 1) or (not dense_done and t < max_new - 1):
        rows, tokens = [], []
        if t < cont_steps:
            for v in variants:
                rows.append(("cont", v))
                tokens.append(answer[t])
        if not path_done:
            for v in variants:
                rows.append(("path", v))
                tokens.append(greedy_fp16[t])
        if not dense_done:
            tokens.append(dense_tokens[t])
        positions = [n0 + t] * len(tokens)
        nm = len(rows)
        if nm:
            step = engine.step()
            if step.rejected or step.preempted or step.swapped_out or step.demotions:
                raise RuntimeError(f"step {step.step}: the cache was expected to hold every variant: {step}")
            # The model's batch is in `rows` order; the engine's is step.decodes.
            where = {f"{kind}:{v}": r for r, (kind, v) in enumerate(rows)}
            order = [where[i] for i in step.decodes]
            if sorted(order) != list(range(nm)):
                raise RuntimeError(f"step {step.step} decodes {step.decodes}, expected {sorted(where)}")

        def attend(layer, q, k, v):
            out = np.empty(q.shape, dtype=np.float32)
            if nm:
                out[order] = from_engine(
                    engine.attend(
                        layer,
                        to_engine(engine, q[order].astype(np.float16)),
                        to_engine(engine, k[order]),
                        to_engine(engine, v[order]),
                    )
                )
            if not dense_done:
                out[nm] = dense.attend(layer, q[nm], k[nm : nm + 1], v[nm : nm + 1])
            return out

        logits = model.decode_step(tokens, positions, attend)
        for r, (kind, v) in enumerate(rows):
            if kind == "cont":
                rec[v]["cont_logp"].append(float(log_softmax(logits[r])[answer[t + 1]]))
                rec[v]["cont_argmax"].append(int(np.argmax(logits[r])))
            else:
                rec[v]["path_argmax"].append(int(np.argmax(logits[r])))
        if t + 1 == cont_steps:
            finish("cont")
        if not path_done:
            r_fp16 = rows.index(("path", variants[0]))
            nxt = rec[variants[0]]["path_argmax"][-1]
            if not dense_done and dense_tokens == greedy_fp16:  # same inputs so far: compare logits
                max_logit_gap = max(max_logit_gap, float(np.abs(logits[nm] - logits[r_fp16]).max()))
            greedy_fp16.append(nxt)
            path_done = nxt == eos or len(greedy_fp16) >= max_new
            if path_done:
                finish("path")
        if not dense_done:
            d = int(np.argmax(logits[nm]))
            dense_tokens.append(d)
            dense_done = d == eos or len(dense_tokens) >= max_new
        t += 1
        bar.update(1)
    bar.close()
    # Every request is finished: this step only reports them.
    while engine.has_unfinished():
        if engine.step().decodes:
            raise RuntimeError("a request outlived its stream")
    return rec, greedy_fp16, dense_tokens, max_logit_gap


def summarize(name, rec, greedy, fp16_cont_argmax, stats):
    """A variant's row of the table, from its records of decode_all and its
    plan's plan_stats."""
    logp = np.asarray(rec["cont_logp"])
    # Token 0 of the answer comes from the dense prefill in every variant;
    # the perplexity is over the tokens predicted through the mixkv cache.
    ppl = float(np.exp(-logp[1:].mean()))
    cont_agree = float(np.mean(np.asarray(rec["cont_argmax"][1:]) == np.asarray(fp16_cont_argmax[1:])))
    path = np.asarray(rec["path_argmax"][1 : len(greedy)])
    ref = np.asarray(greedy[1:])
    same = path == ref
    prefix = int(np.argmin(same)) if not same.all() else len(same)
    return {
        "variant": name,
        "kv_bytes": int(stats.bytes),
        "fp16_bytes": int(stats.fp16_bytes),
        "bytes_ratio": stats.bytes / stats.fp16_bytes,
        "blocks": list(map(int, stats.blocks)),
        "ppl": ppl,
        "cont_agreement": cont_agree,
        "greedy_agreement": float(same.mean()) if len(same) else 1.0,
        "greedy_identical_prefix": prefix,
        "greedy_len": int(len(same)),
    }
