"""The serving loop: continuous batching of requests through one attention
backend (backends.py) and the torch model (torch_model.py, graphs.py).

Every step: the backend's scheduler picks the step's rows (step()); steps
with prompt chunks run every row (chunks first, then the decode batch)
through the model eagerly, the chunks' attention by backend.prefill() (the
prompt is read through the cache: no dense copy is kept) and the decodes'
by backend.attend_into(); decode-only steps run as CUDA graphs around the
attention calls (ModelRunner.decode). Sampling is greedy, or teacher-forced
on a request's `forced` tokens (then the log-probability of each forced
token is recorded). A request whose recompute-preempted prompt is prefilled
again reads its generated tokens as prompt rows, and its last chunk samples
its next token, as in mixkv.Engine.

What is recorded: every step's kind (decode-only or with prompt rows),
rows, decode batch and wall time (from step() to the sampled tokens on the
host), the KV bytes in use, the host time of backend.step() alone (the
scheduler and the enqueueing of its memory moves), and per request its
tokens and log-probs.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ServeResult(dict):
    """tokens, logprobs (by request id), steps ([kind, rows, batch, seconds, used_bytes, step_seconds]), wall
    seconds..."""


def serve(
    runner,
    backend,
    requests,
    *,
    stop_at_eos: bool = False,
    eos_id: int = -1,
    progress=None,
    time_limit: float | None = None,
    check=False,
):
    """Runs `requests` (workload.Request, all arriving at once) to completion through `backend`.

    stop_at_eos: a greedy request that samples eos_id finishes there (backend.finish); otherwise every request
    generates its max_new_tokens (the fixed output lengths of a throughput benchmark). progress: a tqdm-like
    bar (update(n) per token). time_limit: seconds after which the run stops early (result['complete'] False).
    check: call backend.check() after every step (mixkv's invariants)."""
    model = runner.model
    dev = model.device
    by_id = {}
    for r in requests:
        if r.id in by_id:
            raise ValueError(f"request id {r.id!r}: used twice")
        if r.forced is not None and len(r.forced) < r.max_new_tokens:
            raise ValueError(f"request {r.id}: forced holds {len(r.forced)} tokens, expected >= max_new_tokens")
        if r.prompt.num_tokens + r.max_new_tokens > model.max_positions:
            raise ValueError(
                f"request {r.id}: {r.prompt.num_tokens} prompt + {r.max_new_tokens} new tokens exceed the model's "
                f"{model.max_positions} positions (max_positions)"
            )
        by_id[r.id] = r
    tokens = {r.id: [] for r in requests}
    logprobs = {r.id: [] for r in requests}
    for r in requests:
        backend.add(r)
    steps = []
    finished, rejected = {}, {}
    _sync(dev)
    t_start = time.perf_counter()
    complete = True

    def take(rid, token, lp):
        r = by_id[rid]
        t = len(tokens[rid])
        fed = int(r.forced[t]) if r.forced is not None else int(token)
        tokens[rid].append(fed)
        if lp is not None:
            logprobs[rid].append(float(lp))
        if stop_at_eos and r.forced is None and fed == eos_id and len(tokens[rid]) < r.max_new_tokens:
            backend.finish(rid)

    def target(rid):
        r = by_id[rid]
        t = len(tokens[rid])
        return int(r.forced[t]) if r.forced is not None and t < len(r.forced) else 0

    while backend.has_unfinished():
        if time_limit is not None and time.perf_counter() - t_start > time_limit:
            complete = False
            break
        t0 = time.perf_counter()
        step = backend.step()
        t_scheduled = time.perf_counter()
        for f in step.finished:
            finished[f.request_id] = len(tokens[f.request_id])
        for r in step.rejected:
            rejected[r.request_id] = r.reason
        decodes = list(step.decodes)
        if not step.prefills and not decodes:
            continue
        # Decode rows: each request's last token, at the position after its prompt and earlier tokens.
        dec_ids = np.asarray([tokens[r][-1] for r in decodes], dtype=np.int64)
        dec_pos = np.asarray([by_id[r].prompt.num_tokens + len(tokens[r]) - 1 for r in decodes], dtype=np.int64)
        dec_tgt = np.asarray([target(r) for r in decodes], dtype=np.int64) if runner.logprobs else None
        if step.prefills:
            ids, pos, sample_rows, samplers = [], [], [], []
            row = 0
            for chunk in step.prefills:
                r = by_id[chunk.request_id]
                if chunk.end > r.prompt.num_tokens + len(tokens[chunk.request_id]):
                    raise RuntimeError(f"step {len(steps)}: chunk {chunk} runs past request {r.id}'s tokens")
                full = (
                    r.prompt.ids
                    if chunk.end <= r.prompt.num_tokens
                    else np.concatenate([r.prompt.ids, np.asarray(tokens[chunk.request_id], dtype=np.int64)])
                )
                ids.append(full[chunk.start : chunk.end])
                pos.append(np.arange(chunk.start, chunk.end, dtype=np.int64))
                row += chunk.end - chunk.start
                if chunk.last:
                    sample_rows.append(row - 1)
                    samplers.append(chunk.request_id)
            num_prefill = row
            ids.append(dec_ids)
            pos.append(dec_pos)
            sample_rows += list(range(num_prefill, num_prefill + len(decodes)))
            samplers += decodes
            targets = np.asarray([target(r) for r in samplers], dtype=np.int64) if runner.logprobs else None

            def attend(layer, q, k, v, p=num_prefill):
                out = backend.prefill(layer, q[:p], k[:p], v[:p])
                if q.shape[0] == p:
                    return out
                rest = torch.empty_like(q[p:])
                backend.attend_into(layer, q[p:], k[p:], v[p:], rest)
                return torch.cat([out, rest])

            best, lps = runner.eager(np.concatenate(ids), np.concatenate(pos), attend, sample_rows, targets)
            kind = "mixed"
        else:
            num_prefill = 0
            best, lps = runner.decode(dec_ids, dec_pos, backend.attend_into, dec_tgt)
            samplers = decodes
            kind = "decode"
        for i, rid in enumerate(samplers):
            take(rid, best[i], None if lps is None else lps[i])
        seconds = time.perf_counter() - t0
        steps.append((kind, num_prefill, len(decodes), seconds, backend.used_bytes(), t_scheduled - t0))
        if check:
            backend.check()
        if progress is not None:
            progress.update(len(samplers))
    _sync(dev)
    wall = time.perf_counter() - t_start
    return ServeResult(
        tokens=tokens,
        logprobs=logprobs,
        steps=steps,
        wall_seconds=wall,
        finished=finished,
        rejected=rejected,
        complete=complete and not backend.has_unfinished(),
    )


def summarize(result: ServeResult, requests) -> dict:
    """Throughput and step-time figures of a run."""
    steps = result["steps"]
    dec = [s for s in steps if s[0] == "decode"]
    dec_times = np.asarray([s[3] for s in dec]) if dec else np.zeros(0)
    dec_batches = np.asarray([s[2] for s in dec]) if dec else np.zeros(0)
    dec_sched = np.asarray([s[5] for s in dec]) if dec else np.zeros(0)
    out_tokens = sum(len(t) for t in result["tokens"].values())
    prompt_tokens = sum(r.prompt.num_tokens for r in requests)
    all_batches = [s[2] for s in steps]

    def pct(a, q):
        return float(np.percentile(a, q) * 1000) if len(a) else None

    return {
        "requests": len(requests),
        "finished": len(result["finished"]),
        "rejected": len(result["rejected"]),
        "complete": bool(result["complete"]),
        "prompt_tokens": int(prompt_tokens),
        "output_tokens": int(out_tokens),
        "wall_s": result["wall_seconds"],
        "output_tok_s": out_tokens / result["wall_seconds"] if result["wall_seconds"] > 0 else None,
        "steps": len(steps),
        "mixed_steps": len(steps) - len(dec),
        "mixed_s": float(sum(s[3] for s in steps if s[0] != "decode")),
        "decode_steps": len(dec),
        "decode_s": float(dec_times.sum()),
        "decode_tok_s": float(dec_batches.sum() / dec_times.sum()) if len(dec) and dec_times.sum() > 0 else None,
        "decode_step_ms_p50": pct(dec_times, 50),
        "decode_step_ms_p99": pct(dec_times, 99),
        # Of a decode step, the host time of backend.step() (scheduling, page tables, plan).
        "decode_schedule_ms_p50": pct(dec_sched, 50),
        "decode_schedule_ms_p99": pct(dec_sched, 99),
        "decode_batch_max": int(dec_batches.max()) if len(dec) else 0,
        "decode_batch_mean": float(dec_batches.mean()) if len(dec) else 0.0,
        "batch_max": int(max(all_batches)) if all_batches else 0,
        "kv_bytes_peak": int(max((s[4] for s in steps), default=0)),
    }
