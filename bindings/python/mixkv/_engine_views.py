"""The values mixkv.Engine hands out: what a step returns (EngineStep and
its Prefill, Finished and Rejected records) and the read-only view of the
cache (CacheView). mixkv.engine re-exports them; the package exports them as
mixkv.EngineStep, mixkv.CacheView, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Union

from ._core import CacheConfig, FinishReason, PrecisionPlan, TokenLayout

if TYPE_CHECKING:
    from .engine import Engine

RequestKey = Union[str, int]

__all__ = ["CacheView", "EngineStep", "Finished", "Prefill", "Rejected", "RequestKey"]


class Prefill(NamedTuple):
    """Prompt rows [start, end) of a request computed in this step; ``last``:
    they complete the prompt, so the model samples the request's next token
    from the last row."""

    request_id: RequestKey
    start: int
    end: int
    last: bool


class Finished(NamedTuple):
    """A request that left: why (FinishReason), how many tokens it generated,
    and a note when the scheduler ended it itself (empty otherwise)."""

    request_id: RequestKey
    reason: FinishReason
    generated: int
    note: str


class Rejected(NamedTuple):
    """A request that can never fit the cache, with the reason."""

    request_id: RequestKey
    reason: str


class EngineStep:
    """What the model runs in one step, its memory moves already applied.

    ``prefills``: the prompt chunks (Prefill), in the order their rows are
    concatenated for ``Engine.prefill`` / ``Engine.store``; ``prefill_rows``
    rows in all. ``decodes``: the requests of the decode batch, in batch
    order (row i of ``Engine.attend``'s arrays is ``decodes[i]``).
    ``decode_rows``: empty unless some decode has draft tokens (speculative
    decoding); then ``len(decodes) + 1`` row offsets: ``decodes[i]`` has the
    rows ``decode_rows[i]`` .. ``decode_rows[i + 1] - 1`` of
    ``Engine.attend``'s arrays, its last sampled token first, then its
    drafts. ``num_decode_rows``: the rows of ``Engine.attend``'s arrays
    either way (``len(decodes)``, or ``decode_rows[-1]``). ``finished`` and
    ``rejected``: requests that left since the previous step (their ids may
    be used again from now on). ``swapped_out`` / ``swapped_in``: requests
    whose blocks moved to / from host memory; ``preempted``: requests whose
    blocks were freed, to be prefilled again later (their prompt then is the
    original prompt followed by the tokens they had generated). Counts of
    the moves applied: ``demotions``, ``swap_out_blocks``, ``swap_in_blocks``,
    ``copies``.
    """

    __slots__ = (
        "step",
        "prefills",
        "prefill_rows",
        "decodes",
        "decode_rows",
        "num_decode_rows",
        "finished",
        "rejected",
        "swapped_out",
        "swapped_in",
        "preempted",
        "num_batched_tokens",
        "demotions",
        "age_demotions",
        "swap_out_blocks",
        "swap_in_blocks",
        "copies",
    )

    def __init__(self, raw: dict, key_of) -> None:
        self.step: int = raw["step"]
        self.prefills: list[Prefill] = [Prefill(key_of(i), s, e, last) for i, s, e, last in raw["prefills"]]
        self.prefill_rows: int = sum(p.end - p.start for p in self.prefills)
        self.decodes: list[RequestKey] = [key_of(i) for i in raw["decodes"]]
        self.decode_rows: list[int] = list(raw["decode_rows"])
        self.num_decode_rows: int = self.decode_rows[-1] if self.decode_rows else len(self.decodes)
        self.finished: list[Finished] = [
            Finished(key_of(i), FinishReason(r), g, note) for i, r, g, note in raw["finished"]
        ]
        self.rejected: list[Rejected] = [Rejected(key_of(i), why) for i, why in raw["rejected"]]
        self.swapped_out: list[RequestKey] = [key_of(i) for i in raw["swapped_out"]]
        self.swapped_in: list[RequestKey] = [key_of(i) for i in raw["swapped_in"]]
        self.preempted: list[RequestKey] = [key_of(i) for i in raw["preempted"]]
        self.num_batched_tokens: int = raw["num_batched_tokens"]
        self.demotions: int = raw["num_demotions"]
        self.age_demotions: int = raw["num_age_demotions"]  # of them, windows demoted by age (age tiers)
        self.swap_out_blocks: int = raw["num_swap_out"]
        self.swap_in_blocks: int = raw["num_swap_in"]
        self.copies: int = raw["num_copies"]

    def __repr__(self) -> str:
        return (
            f"EngineStep(step={self.step}, prefills={self.prefills}, decodes={self.decodes}, "
            f"decode_rows={self.decode_rows}, "
            f"finished={self.finished}, rejected={self.rejected}, swapped_out={self.swapped_out}, "
            f"swapped_in={self.swapped_in}, preempted={self.preempted}, demotions={self.demotions})"
        )


class CacheView:
    """The engine's cache manager, read only: pool statistics, formats and
    each request's blocks (by the caller's request ids). Changing the cache
    is the engine's business (add_request, fork, finish, cancel)."""

    __slots__ = ("_engine", "_manager")

    def __init__(self, engine: "Engine", manager) -> None:
        self._engine = engine
        self._manager = manager

    def _id(self, fn: str, request_id: RequestKey) -> int:
        return self._engine._internal(f"Engine.cache.{fn}", "request_id", request_id)

    @property
    def config(self) -> CacheConfig:
        """A copy of the cache's configuration."""
        return self._manager.config

    @property
    def total_slabs(self) -> int:
        return self._manager.total_slabs

    @property
    def free_slabs(self) -> int:
        return self._manager.free_slabs

    def format(self, precision):
        """The BlockFormat of a pool."""
        return self._manager.format(precision)

    def prefix_stats(self):
        """The prefix index's blocks and counters (mixkv.PrefixCacheStats)."""
        return self._manager.prefix_stats()

    def pool_stats(self, precision):
        """Blocks and slabs of a pool now (PoolStats)."""
        return self._manager.pool_stats(precision)

    def demand(self, layout: TokenLayout, plan: PrecisionPlan):
        """Blocks per pool [FP16, INT4, INT2] a prompt needs over all layers."""
        return self._manager.demand(layout, plan)

    def can_allocate(self, blocks) -> bool:
        return self._manager.can_allocate(blocks)

    def holds(self, request_id: RequestKey) -> bool:
        """Whether the request holds memory now (device blocks or host swap slots)."""
        return self._manager.contains(self._id("holds", request_id))

    def num_tokens(self, request_id: RequestKey) -> int:
        return self._manager.num_tokens(self._id("num_tokens", request_id))

    def plan(self, request_id: RequestKey) -> PrecisionPlan:
        return self._manager.plan(self._id("plan", request_id))

    def blocks(self, request_id: RequestKey, layer: int, precision):
        """Block ids of (request, layer, pool) in order (NumPy int32)."""
        return self._manager.blocks(self._id("blocks", request_id), layer, precision)

    def blocks_held(self, request_id: RequestKey):
        return self._manager.blocks_held(self._id("blocks_held", request_id))

    def is_swapped(self, request_id: RequestKey) -> bool:
        return self._manager.is_swapped(self._id("is_swapped", request_id))

    def free_swap_slots(self):
        return self._manager.free_swap_slots()

    def check_invariants(self) -> None:
        self._manager.check_invariants()

    def describe_state(self) -> str:
        return self._manager.describe_state()
