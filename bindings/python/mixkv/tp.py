"""mixkv.tp: mixkv.Engine on every rank of a tensor-parallel group.

Each rank of a torch.distributed group holds ``num_kv_heads / tp`` of the
model's KV heads (and ``num_q_heads / tp`` query heads) in a cache of its
own. Every rank runs the same deterministic scheduler over a cache of the
same geometry (the same blocks per slab, the same slabs), fed the same
inputs in the same order, so block ids, page tables, demotions, swaps and
preemptions come out the same on every rank without shipping them:

- requests, forks, finishes, cancels and speculative-decoding calls enter on
  rank 0 (the leader), which applies them at once and sends them to the
  other ranks (followers) with the next ``step()``; the followers replay
  them, then every rank runs its own ``step()``;
- what is not deterministic is decided once on rank 0 and sent as a value:
  the arrival time, and the WindowQuant plan of a request that comes with
  embeddings (the followers never see the embeddings);
- with ``check`` on, every step ends with the ranks comparing a 64-bit
  digest of the step (every id, slot, block id, demotion, swap and copy,
  the page lists that changed, the pools' block counts) and, every
  ``check_state_every`` steps, a digest of the whole bookkeeping
  (``describe_state()``); a mismatch raises TPDivergence naming the step on
  every rank.

Every step also ends with a small exchange of each rank's status, so that an
error on one rank (a replay that fails, a step that raises) raises TPError
on every rank at the same step instead of leaving the others waiting in the
model's next collective. docs/tensor-parallel.md explains the design and
the knobs.

    dist.init_process_group("gloo", ...)                    # or "nccl"
    engine = mixkv.tp.TPEngine(cache_config, num_q_heads=32, backend="cuda", device=local_rank)
    while engine.has_unfinished():                          # collective: rank 0's answer
        step = engine.step(payload=new_prompts if engine.is_leader else None)
        ... the model's shard of every layer: engine.prefill / engine.attend with this rank's heads,
            all-reduce of the attention and MLP outputs ...
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any, Callable, Optional, Union

from . import _tp_wire as _wire
from ._core import (
    CacheConfig,
    CacheShape,
    InvalidArgument,
    PlannerConfig,
    PrecisionPlan,
    SchedulerConfig,
    Segment,
    TokenKind,
    TokenLayout,
    WindowPlanner,
)
from ._engine_views import EngineStep, RequestKey
from .engine import Engine, _check_int

__all__ = ["TPDivergence", "TPEngine", "TPError", "shard_cache_config"]


class TPError(RuntimeError):
    """A rank of the group raised, exited or timed out; the message names
    the rank and the step. The engine refuses every later call: the group's
    ranks may no longer agree."""


class TPDivergence(TPError):
    """The ranks' schedulers or caches disagree (a digest differs, or a
    follower could not replay a call of rank 0); the message names the step
    and the first difference found."""


def shard_cache_config(cache_config: CacheConfig, tp: int) -> CacheConfig:
    """The cache of one rank of ``tp``: the same layers, head_dim, block size,
    dtype, arena, slabs, swap blocks and prefix caching, and ``num_kv_heads /
    tp`` KV heads. ``arena_bytes`` is each rank's budget, so a rank's blocks
    are ``tp`` times smaller and it holds ``tp`` times as many tokens."""
    fn = "shard_cache_config"
    if not isinstance(cache_config, CacheConfig):
        raise InvalidArgument(f"{fn}: cache_config: expected a mixkv.CacheConfig, got {type(cache_config).__name__}")
    _check_int(fn, "tp", tp, 1)
    shape = cache_config.shape
    if shape.num_kv_heads % tp != 0:
        raise InvalidArgument(
            f"{fn}: cache_config.shape.num_kv_heads = {shape.num_kv_heads}: expected a multiple of tp = {tp} "
            "(each rank holds num_kv_heads / tp whole heads)"
        )
    return CacheConfig(
        CacheShape(shape.num_layers, shape.num_kv_heads // tp, shape.head_dim, shape.block_size, shape.dtype),
        cache_config.arena_bytes,
        cache_config.slab_bytes,
        swap_blocks=cache_config.swap_blocks,
        fp16_windows_first=cache_config.fp16_windows_first,
        prefix_cache=cache_config.prefix_cache,
    )


class TPEngine:
    """mixkv.Engine on one rank of a tensor-parallel group (module docstring).

    ``cache_config`` and ``num_q_heads`` are the whole model's: this rank's
    cache holds ``num_kv_heads / tp`` KV heads (``shard_cache_config``; the
    arena is per rank) and its attention ``num_q_heads / tp`` query heads,
    the rank's slice in head order. ``scheduler_config``, ``planner``,
    ``backend``, ``sm_scale`` and ``max_blocks_per_sequence`` are
    mixkv.Engine's; they must be equal on every rank (checked here, the
    same for the cache), ``device`` is this rank's CUDA device.

    ``group``: the torch.distributed group whose ranks must agree (None:
    the default group): the tensor-parallel group, or every rank of a
    pipeline (docs/tensor-parallel.md). ``tp``: the ways the KV heads are
    split (None: the group's size; with pipeline stages in the group, the
    ranks of one stage). ``control_group``: a gloo group over the same ranks for
    the engine's own messages (None: ``group`` when it is gloo; else one is
    made with ``torch.distributed.new_group(backend="gloo")``, which needs
    ``group`` to be the whole world). Collectives time out after the
    groups' timeout (``init_process_group(timeout=...)``).

    ``check``: compare a digest of every step across the ranks (None: on
    when the environment variable MIXKV_TP_CHECK is 1). ``check_state_every``:
    with ``check``, also compare the digest of ``describe_state()`` (the
    whole bookkeeping, O(blocks)) every that many steps; 0 never.

    Collective calls (every rank calls them, in the same order): the
    constructor, ``step()``, ``has_unfinished()``, ``verify_identical()``.
    Rank 0 alone calls ``add_request``, ``fork``, ``speculate``, ``accept``,
    ``finish`` and ``cancel``; they reach the others with the next
    ``step()``. Everything else is local to the rank.
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        scheduler_config: Optional[SchedulerConfig] = None,
        *,
        num_q_heads: int,
        group: Any = None,
        control_group: Any = None,
        tp: Optional[int] = None,
        backend: str = "cpu",
        planner: Optional[PlannerConfig] = None,
        device: int = 0,
        sm_scale: Optional[float] = None,
        max_blocks_per_sequence: int = 0,
        check: Optional[bool] = None,
        check_state_every: int = 0,
    ) -> None:
        fn = "TPEngine"
        try:
            import torch
            import torch.distributed as dist
        except ImportError as error:
            raise ImportError(f"{fn}: mixkv.tp needs torch (torch.distributed): {error}") from None
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgument(
                f"{fn}: group: torch.distributed is not initialized: call torch.distributed.init_process_group first"
            )
        self._torch = torch
        self._dist = dist
        self._group = group if group is not None else dist.group.WORLD
        self._size = dist.get_world_size(self._group)
        self._rank = dist.get_rank(self._group)
        if self._rank < 0:
            raise InvalidArgument(f"{fn}: group: this process is not a member of the group")
        self._leader = dist.get_global_rank(self._group, 0) if group is not None else 0
        if control_group is None:
            if dist.get_backend(self._group) == "gloo":
                control_group = self._group
            elif self._size == dist.get_world_size():
                control_group = dist.new_group(backend="gloo")
            else:
                raise InvalidArgument(
                    f"{fn}: control_group: None, and group is a {dist.get_backend(self._group)} group smaller than "
                    "the world: expected a gloo group over the same ranks (torch.distributed.new_group(ranks, "
                    'backend="gloo"), made by every rank of the world)'
                )
        elif dist.get_world_size(control_group) != self._size or dist.get_rank(control_group) != self._rank:
            raise InvalidArgument(
                f"{fn}: control_group: expected the ranks of group in the same order "
                f"(size {self._size}, this rank {self._rank}), got size {dist.get_world_size(control_group)}, "
                f"rank {dist.get_rank(control_group)}"
            )
        self._control = control_group
        if tp is None:
            tp = self._size
        _check_int(fn, "tp", tp, 1)
        if self._size % tp != 0:
            raise InvalidArgument(f"{fn}: tp = {tp}: expected a divisor of the group's size {self._size}")
        self._tp = tp
        _check_int(fn, "num_q_heads", num_q_heads, 1)
        if num_q_heads % tp != 0:
            raise InvalidArgument(f"{fn}: num_q_heads = {num_q_heads}: expected a multiple of tp = {tp}")
        if check is None:
            check = os.environ.get("MIXKV_TP_CHECK", "0") == "1"
        elif not isinstance(check, bool):
            raise InvalidArgument(f"{fn}: check: expected a bool or None, got {type(check).__name__}")
        _check_int(fn, "check_state_every", check_state_every, 0)
        shard = shard_cache_config(cache_config, tp)
        if scheduler_config is None:
            scheduler_config = SchedulerConfig()
        self._engine = Engine(
            shard,
            scheduler_config,
            num_q_heads=num_q_heads // tp,
            backend=backend,
            planner=planner,
            device=device,
            sm_scale=sm_scale,
            max_blocks_per_sequence=max_blocks_per_sequence,
        )
        self._check = check
        self._check_state_every = check_state_every
        planner_config = self._engine.config.scheduler.planner
        # Only rank 0 plans: the followers take its plans as values.
        self._planner = WindowPlanner(planner_config) if planner_config is not None and self._rank == 0 else None
        self._log: list = []  # rank 0: the calls since the last step, in order
        self._steps = 0
        self._payload: Any = None
        self._seconds = (0.0, 0.0)
        self._asked_seconds = 0.0  # has_unfinished() since the last step, counted in the next step's messages
        self._failed: Optional[str] = None
        self._agree_on_config(fn, num_q_heads, sm_scale, max_blocks_per_sequence)

    # -- the group ------------------------------------------------------------------------------------------------
    def _collective(self, fn: str, what: str, call: Callable[[], Any]) -> Any:
        """Runs one collective; a failure of the group (a peer that exited,
        the timeout) becomes TPError naming the call and the step."""
        try:
            return call()
        except Exception as error:
            if isinstance(error, InvalidArgument):
                raise
            self._failed = (
                f"{fn}: step {self._steps}: rank {self._rank}: {what} failed: another rank raised or exited, "
                f"or the group's timeout passed ({type(error).__name__}: {error})"
            )
            raise TPError(self._failed) from error

    def _usable(self, fn: str) -> None:
        if self._failed is not None:
            raise TPError(f"{fn}: this engine's group failed before and its ranks may disagree: {self._failed}")

    def _agree_on_config(self, fn: str, num_q_heads: int, sm_scale: Any, max_blocks: int) -> None:
        config = self._engine.config
        mine = {
            "cache_config": _wire.describe(config.cache),
            "scheduler_config": _wire.describe(config.scheduler),
            "num_q_heads": num_q_heads,
            "tp": self._tp,
            "backend": self._engine.backend,
            "sm_scale": sm_scale,
            "max_blocks_per_sequence": max_blocks,
            "check": self._check,
            "check_state_every": self._check_state_every,
        }
        everyone: list = [None] * self._size
        self._collective(
            fn,
            "the comparison of the ranks' configurations",
            lambda: self._dist.all_gather_object(everyone, mine, group=self._control),
        )
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                names = [k for k in everyone[0] if everyone[0][k] != theirs.get(k)]
                raise InvalidArgument(
                    f"{fn}: rank {r}'s configuration differs from rank 0's in {', '.join(names)}: every rank "
                    "must build its engine from the same arguments (device aside)"
                )

    def _leader_only(self, fn: str) -> None:
        self._usable(fn)
        if self._rank != 0:
            raise InvalidArgument(
                f"{fn}: called on rank {self._rank}: requests, forks, finishes and cancels enter on rank 0, "
                "which sends them to the other ranks with the next step()"
            )

    # -- rank 0's calls -------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: RequestKey,
        layout_or_num_tokens: Union[TokenLayout, int],
        *,
        plan: Optional[PrecisionPlan] = None,
        embeddings: Any = None,
        max_new_tokens: int,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        token_keys: Any = None,
    ) -> None:
        """Engine.add_request on rank 0. A request with ``embeddings`` is
        planned here, once: every rank receives the plan, none the
        embeddings. ``arrival_time`` None is rank 0's time.monotonic()."""
        fn = "TPEngine.add_request"
        self._leader_only(fn)
        if arrival_time is None:
            arrival_time = time.monotonic()
        layout = layout_or_num_tokens
        if isinstance(layout, int) and not isinstance(layout, bool) and layout >= 1:
            layout = TokenLayout([Segment(TokenKind.Text, layout)])
        if embeddings is not None and plan is None and self._planner is not None and isinstance(layout, TokenLayout):
            try:
                plan = self._planner.plan(layout, embeddings)
            except (InvalidArgument, TypeError) as error:
                raise InvalidArgument(f"{fn}(request_id={request_id!r}): embeddings: {error}") from None
            embeddings = None
        self._engine.add_request(
            request_id,
            layout,
            plan=plan,
            embeddings=embeddings,
            max_new_tokens=max_new_tokens,
            priority=priority,
            arrival_time=arrival_time,
            token_keys=token_keys,
        )
        keys = None if token_keys is None else [int(k) for k in token_keys]
        self._log.append(
            (
                "add_request",
                request_id,
                self._engine._ids[request_id],
                _wire.layout_state(layout),
                _wire.plan_state(plan),
                max_new_tokens,
                priority,
                float(arrival_time),
                keys,
            )
        )

    def fork(self, parent_id: RequestKey, child_id: RequestKey, max_new_tokens: Optional[int] = None) -> None:
        """Engine.fork on rank 0."""
        self._leader_only("TPEngine.fork")
        self._engine.fork(parent_id, child_id, max_new_tokens)
        self._log.append(("fork", parent_id, child_id, self._engine._ids[child_id], max_new_tokens))

    def speculate(self, request_id: RequestKey, num_drafts: int) -> None:
        """Engine.speculate on rank 0."""
        self._leader_only("TPEngine.speculate")
        self._engine.speculate(request_id, num_drafts)
        self._log.append(("speculate", request_id, num_drafts))

    def accept(self, request_id: RequestKey, num_accepted: int) -> None:
        """Engine.accept on rank 0."""
        self._leader_only("TPEngine.accept")
        self._engine.accept(request_id, num_accepted)
        self._log.append(("accept", request_id, num_accepted))

    def finish(self, request_id: RequestKey) -> bool:
        """Engine.finish on rank 0."""
        self._leader_only("TPEngine.finish")
        done = self._engine.finish(request_id)
        if done:  # a False changed nothing anywhere
            self._log.append(("finish", request_id))
        return done

    def cancel(self, request_id: RequestKey) -> bool:
        """Engine.cancel on rank 0."""
        self._leader_only("TPEngine.cancel")
        done = self._engine.cancel(request_id)
        if done:
            self._log.append(("cancel", request_id))
        return done

    def _replay(self, command: tuple) -> None:
        """A follower applies one of rank 0's calls. Rank 0 may have spent
        internal ids on calls that raised (they are never sent), so each new
        request takes the internal id rank 0 gave it: the step digests
        compare internal ids."""
        kind, engine = command[0], self._engine
        if kind == "add_request":
            _, key, internal, layout, plan, max_new_tokens, priority, arrival_time, keys = command
            if internal < engine._next_id:
                raise TPDivergence(f"internal id {internal} is taken here already (next {engine._next_id})")
            engine._next_id = internal
            engine.add_request(
                key,
                _wire.layout_of(layout),
                plan=_wire.plan_of(plan),
                max_new_tokens=max_new_tokens,
                priority=priority,
                arrival_time=arrival_time,
                token_keys=keys,
            )
        elif kind == "fork":
            _, parent, child, internal, max_new_tokens = command
            if internal < engine._next_id:
                raise TPDivergence(f"internal id {internal} is taken here already (next {engine._next_id})")
            engine._next_id = internal
            engine.fork(parent, child, max_new_tokens)
        elif kind == "speculate":
            engine.speculate(command[1], command[2])
        elif kind == "accept":
            engine.accept(command[1], command[2])
        elif kind in ("finish", "cancel"):
            if not getattr(engine, kind)(command[1]):
                raise TPDivergence(f"request {command[1]!r} had already left this rank")
        else:
            raise TPDivergence(f"unknown call {kind!r}")

    # -- the step -------------------------------------------------------------------------------------------------
    def step(self, *, payload: Any = None, stream: Any = None) -> EngineStep:
        """Collective. Rank 0 sends the calls made since the last step and
        ``payload`` (any picklable object, e.g. new prompts' token ids and
        the tokens it sampled; None on the other ranks), the followers
        replay the calls, then every rank runs Engine.step(); ``payload``
        (the property) is rank 0's payload afterwards on every rank. Raises
        TPError on every rank when one rank failed in this step, and
        TPDivergence when the ranks' steps differ (``check``)."""
        fn = "TPEngine.step"
        self._usable(fn)
        n = self._steps + 1
        blob = b""
        if self._rank == 0:
            try:
                blob = pickle.dumps((n, self._log, payload), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:
                raise InvalidArgument(f"{fn}: payload: cannot be pickled ({type(error).__name__}: {error})") from None
        elif payload is not None:
            raise InvalidArgument(f"{fn}: payload: given on rank {self._rank}: only rank 0's payload is sent")
        self._steps = n
        start = time.perf_counter()
        blob = self._broadcast_bytes(fn, blob)
        sent_step, commands, self._payload = pickle.loads(blob)
        self._log = []
        error: Optional[BaseException] = None
        if sent_step != n:
            error = TPDivergence(f"rank {self._rank} is at step {n}, rank 0 at step {sent_step}")
        elif self._rank != 0:
            for command in commands:
                try:
                    self._replay(command)
                except Exception as e:
                    error = TPDivergence(
                        f"replaying rank 0's {command[0]}({command[1]!r}) raised {type(e).__name__}: {e}"
                    )
                    error.__cause__ = e
                    break
        result = None
        engine_start = time.perf_counter()
        if error is None:
            try:
                result = self._engine.step(stream=stream)
            except Exception as e:
                error = e
        engine_seconds = time.perf_counter() - engine_start
        digest = state = 0
        if error is None and self._check:
            digest = _wire.signed64(self._engine.step_digest())
            if self._check_state_every and n % self._check_state_every == 0:
                state = _wire.text_digest(self._engine.describe_state())
        self._exchange(fn, n, error, digest, state)
        self._seconds = (time.perf_counter() - start - engine_seconds + self._asked_seconds, engine_seconds)
        self._asked_seconds = 0.0
        return result

    def _broadcast_bytes(self, fn: str, blob: bytes) -> bytes:
        """Rank 0's bytes on every rank (_tp_wire.broadcast_bytes over the control group)."""
        what = "the broadcast of rank 0's calls"

        def broadcast(tensor):
            self._collective(fn, what, lambda: self._dist.broadcast(tensor, self._leader, group=self._control))

        return _wire.broadcast_bytes(self._torch, blob if self._rank == 0 else None, broadcast)

    def _exchange(self, fn: str, n: int, error: Optional[BaseException], digest: int, state: int) -> None:
        """Every rank's (failed, step digest, state digest) to every rank;
        raises on every rank when one failed or the digests differ."""
        torch, dist = self._torch, self._dist
        mine = torch.tensor([1 if error is not None else 0, digest, state], dtype=torch.int64)
        table = [torch.zeros_like(mine) for _ in range(self._size)]
        self._collective(
            fn, f"the status exchange of step {n}", lambda: dist.all_gather(table, mine, group=self._control)
        )
        rows = [t.tolist() for t in table]
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            mine_text = None if error is None else (isinstance(error, TPDivergence), f"{type(error).__name__}: {error}")
            messages: list = [None] * self._size
            self._collective(
                fn,
                "the exchange of the errors",
                lambda: dist.all_gather_object(messages, mine_text, group=self._control),
            )
            diverged, text = messages[failed[0]]
            others = f" (ranks {failed} failed)" if len(failed) > 1 else ""
            self._failed = f"{fn}: step {n}: rank {failed[0]} raised {text}{others}"
            raise (TPDivergence if diverged else TPError)(self._failed) from error
        for column, what in ((1, "step digest"), (2, "describe_state() digest")):
            values = [row[column] for row in rows]
            if any(v != values[0] for v in values):
                texts = self._gather_states(fn)
                digests = ", ".join(f"rank {r} {v & (1 << 64) - 1:016x}" for r, v in enumerate(values))
                self._failed = f"{fn}: step {n}: the ranks diverged: {what} {digests}; first difference: {_wire.first_difference(texts)}"
                raise TPDivergence(self._failed)

    def _gather_states(self, fn: str) -> list:
        """Every rank's describe_state(), on every rank."""
        texts: list = [None] * self._size
        self._collective(
            fn,
            "the exchange of describe_state()",
            lambda: self._dist.all_gather_object(texts, self._engine.describe_state(), group=self._control),
        )
        return texts

    def has_unfinished(self) -> bool:
        """Collective: rank 0's Engine.has_unfinished(), on every rank (a
        follower has not seen rank 0's calls since the last step yet, so its
        own answer could differ)."""
        fn = "TPEngine.has_unfinished"
        self._usable(fn)
        start = time.perf_counter()
        flag = self._torch.tensor([1 if self._rank == 0 and self._engine.has_unfinished() else 0])
        self._collective(
            fn,
            "the broadcast of rank 0's answer",
            lambda: self._dist.broadcast(flag, self._leader, group=self._control),
        )
        self._asked_seconds += time.perf_counter() - start
        return bool(flag.item())

    def verify_identical(self) -> None:
        """Collective: raises TPDivergence unless every rank's
        describe_state() (scheduler queues, every page table, pool and slab)
        equals rank 0's. O(blocks): for tests and after a run."""
        fn = "TPEngine.verify_identical"
        self._usable(fn)
        texts = self._gather_states(fn)
        if any(t != texts[0] for t in texts):
            raise TPDivergence(f"{fn}: after step {self._steps}: first difference: {_wire.first_difference(texts)}")

    # -- this rank's shard ----------------------------------------------------------------------------------------
    def store(self, layer: int, k: Any, v: Any, *, stream: Any = None) -> None:
        """Engine.store with this rank's KV heads: k, v [rows, num_kv_heads / tp, head_dim]."""
        self._engine.store(layer, k, v, stream=stream)

    def prefill(
        self, layer: int, q: Any, k: Any, v: Any, out: Any = None, lse: Any = None, *, stream: Any = None
    ) -> Any:
        """Engine.prefill with this rank's heads: q [rows, num_q_heads / tp, head_dim], k, v [rows,
        num_kv_heads / tp, head_dim]."""
        return self._engine.prefill(layer, q, k, v, out, lse, stream=stream)

    def attend(
        self, layer: int, q: Any, k: Any, v: Any, out: Any = None, lse: Any = None, *, stream: Any = None
    ) -> Any:
        """Engine.attend with this rank's heads (as prefill)."""
        return self._engine.attend(layer, q, k, v, out, lse, stream=stream)

    def synchronize(self) -> None:
        self._engine.synchronize()

    # -- inspection (local) ---------------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """This rank's mixkv.Engine, for inspection: changing it outside
        TPEngine makes the ranks diverge."""
        return self._engine

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def tp_size(self) -> int:
        """The ways the KV heads are split."""
        return self._tp

    @property
    def group_size(self) -> int:
        """The ranks that agree (tp_size unless pipeline stages share the group)."""
        return self._size

    @property
    def is_leader(self) -> bool:
        return self._rank == 0

    @property
    def payload(self) -> Any:
        """Rank 0's payload of the last step()."""
        return self._payload

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def step_seconds(self) -> tuple:
        """(seconds of the last step() spent on the group's messages (and
        of the has_unfinished() calls before it), the replay and the
        digests; seconds in Engine.step)."""
        return self._seconds

    @property
    def cache(self):
        return self._engine.cache

    @property
    def config(self):
        """This rank's EngineConfig (its shard of the cache)."""
        return self._engine.config

    def status(self, request_id: RequestKey):
        return self._engine.status(request_id)

    def stats(self):
        return self._engine.stats()

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._engine

    def check_invariants(self) -> None:
        self._engine.check_invariants()

    def describe_state(self) -> str:
        return self._engine.describe_state()

    def step_digest(self) -> int:
        """This rank's Engine.step_digest() (the one ``check`` compares)."""
        return self._engine.step_digest()

    def __repr__(self) -> str:
        return f"mixkv.tp.TPEngine(rank {self._rank} of {self._size}, {self._engine!r}, check={self._check})"
