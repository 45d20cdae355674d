"""The attention backends of the serving loop, one interface:

  add(request), step() -> a step (mixkv.EngineStep's attributes: prefills,
  decodes, finished, rejected, preempted, prefill_rows), prefill(layer, q,
  k, v) -> out for the step's prompt rows, attend_into(layer, q, k, v, out)
  for its decode rows, finish(id), has_unfinished(), used_bytes(),
  describe(), close().

MixkvBackend is mixkv.Engine (its scheduler, its cache of three pools, its
prefill and decode attention), CPU or CUDA. FlashInferBackend
(flashinfer_backend.py) is FlashInfer's paged prefill and decode attention
over a plain paged cache under the same scheduling rule (paged.py), FP16 or
FP8 K/V; PagedKVBackend is that cache with torch attention (CPU tests).
Every backend gets the same KV budget in bytes.
"""

from __future__ import annotations

import math

import mixkv
import torch
from workload import FLASHINFER_PLANS, MIXKV_PLANS

PREFILL_MODES = {"exact": mixkv.PrefillMode.Exact, "compact": mixkv.PrefillMode.Compact}


class MixkvBackend:
    """mixkv.Engine with a KV arena of `budget_bytes`; requests bring their plans.

    Demotion under pressure is off, so that each plan is measured as planned (with it on, the FP16 plan
    would be demoted to INT4 and INT2 under pressure); a decode that finds no room preempts by recompute,
    as the paged backends do."""

    name = "mixkv"

    def __init__(
        self,
        config,
        budget_bytes: int,
        device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_tokens_per_request: int,
        prefill_mode: str = "compact",
        block_size: int = 32,
        slab_bytes: int | None = None,
    ):
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"--prefill-mode {prefill_mode!r}: expected one of {', '.join(PREFILL_MODES)}")
        c = config
        self.config = c
        shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, block_size)
        cache = mixkv.CacheConfig(shape, int(budget_bytes), fp16_windows_first=prefill_mode == "exact")
        if slab_bytes is not None:
            cache.slab_bytes = slab_bytes
        sched = mixkv.SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            demote_under_pressure=False,
            preemption=mixkv.PreemptionMode.Recompute,
            prefill_mode=PREFILL_MODES[prefill_mode],
        )
        backend = "cuda" if torch.device(device).type == "cuda" else "cpu"
        # Page lists are bounded by the longest request (a window more for the partly filled tail): the
        # device page tables are sized max_num_seqs x that bound per layer and pool.
        bound = math.ceil(max_tokens_per_request / block_size) + 2
        self.engine = mixkv.Engine(
            cache,
            sched,
            num_q_heads=c.num_heads,
            backend=backend,
            device=torch.device(device).index or 0,
            max_blocks_per_sequence=bound,
        )
        self.block_bytes = [self.engine.cache.format(p).block_bytes for p in mixkv.Precision]
        self.slab_bytes = cache.slab_bytes
        self.prefill_mode = prefill_mode
        self.peak_bytes = 0
        self.peak_slab_bytes = 0

    def add(self, request):
        if request.plan is None:
            raise ValueError(f"request {request.id}: a mixkv request needs its plan")
        self.engine.add_request(
            request.id, request.prompt.layout, plan=request.plan, max_new_tokens=request.max_new_tokens
        )

    def step(self):
        step = self.engine.step()
        used = self.used_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        view = self.engine.cache
        self.peak_slab_bytes = max(self.peak_slab_bytes, (view.total_slabs - view.free_slabs) * self.slab_bytes)
        return step

    def prefill(self, layer: int, q, k, v):
        return self.engine.prefill(layer, q, k, v)

    def attend_into(self, layer: int, q, k, v, out):
        return self.engine.attend(layer, q, k, v, out=out)

    def finish(self, request_id) -> bool:
        return self.engine.finish(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def used_bytes(self) -> int:
        """Bytes of the blocks in use, every pool."""
        view = self.engine.cache
        return sum(view.pool_stats(p).used_blocks * self.block_bytes[p] for p in mixkv.Precision)

    def describe(self) -> dict:
        stats = self.engine.stats()
        return {
            "block_bytes": {p.name: self.block_bytes[p] for p in mixkv.Precision},
            "slab_bytes": self.slab_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_slab_bytes": self.peak_slab_bytes,
            "prefill_mode": self.prefill_mode,
            "preemptions": int(stats.preempted_recompute),
            "plan_demotions": int(stats.plan_demotions),
        }

    def check(self):
        self.engine.check_invariants()

    def close(self):
        self.engine = None


def make_backend(
    key: str,
    config,
    budget_bytes: int,
    device,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_tokens_per_request: int,
    prefill_mode: str = "compact",
    page_size: int = 16,
    attention: str = "flashinfer",
    slab_bytes: int | None = None,
):
    """The backend of plan `key` (workload.ALL_PLANS). attention = "torch" runs the FlashInfer plans' paged
    cache with torch attention instead of FlashInfer's (CPU tests)."""
    if key in MIXKV_PLANS:
        return MixkvBackend(
            config,
            budget_bytes,
            device,
            max_num_seqs,
            max_num_batched_tokens,
            max_tokens_per_request,
            prefill_mode,
            slab_bytes=slab_bytes,
        )
    if key in FLASHINFER_PLANS:
        kv_dtype = torch.float8_e4m3fn if key == "flashinfer-fp8" else torch.float16
        if attention == "torch":
            from paged import PagedKVBackend as Paged
        elif attention == "flashinfer":
            from flashinfer_backend import FlashInferBackend as Paged
        else:
            raise ValueError(f"attention = {attention!r}: expected 'flashinfer' or 'torch'")
        return Paged(
            config,
            budget_bytes,
            device,
            kv_dtype,
            page_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_tokens_per_request,
        )
    raise ValueError(f"plan {key!r}: expected one of {', '.join(list(MIXKV_PLANS) + list(FLASHINFER_PLANS))}")
