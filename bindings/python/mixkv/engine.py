"""mixkv.Engine: the scheduler and a backend (CPU or CUDA) behind one object.

An engine author adds requests, calls ``step()`` once per model step, and per
layer hands the model's K/V/Q to ``prefill()`` (the prompt chunks, attention
through the cache) or ``store()`` (the prompt chunks' K/V after the engine's
own attention), and to ``attend()`` (the decode batch, with its draft rows
under speculative decoding: ``speculate()`` and ``accept()``). Everything
mixkv must do between two steps (demotions, swaps, copy-on-write copies,
page tables, the decode plan) happens inside ``step()``. Arrays cross through
DLPack without copies: NumPy and torch CPU tensors on the CPU backend, torch
and CuPy CUDA tensors on the CUDA backend. docs/python.md walks through a
full loop.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Union

from . import _core
from ._core import (
    CacheConfig,
    InvalidArgument,
    InvariantViolation,
    PlannerConfig,
    PrecisionPlan,
    SchedulerConfig,
    Segment,
    TokenKind,
    TokenLayout,
    UnknownId,
    dtype_name,
)
from ._engine_views import CacheView, EngineStep, Finished, Prefill, Rejected, RequestKey

try:
    from . import _engine
except ImportError as _error:  # a package built without engine/
    _engine = None
    _ENGINE_MISSING = str(_error)

__all__ = ["BackendKind", "CacheView", "Engine", "EngineConfig", "EngineStep", "Finished", "Prefill", "Rejected"]

BackendKind = _engine.BackendKind if _engine is not None else None
EngineConfig = _engine.EngineConfig if _engine is not None else None
# Engine(batch_invariant=True)'s chunk in blocks (kBatchInvariantBlocks, engine.h).
BATCH_INVARIANT_BLOCKS = int(_engine.BATCH_INVARIANT_BLOCKS) if _engine is not None else None


def _check_key(fn: str, arg: str, key: Any) -> RequestKey:
    # bool is an int in Python; True as a request id is a bug, not id 1.
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidArgument(f"{fn}: {arg}: expected a str or an int, got {type(key).__name__}")
    return key


def _check_int(fn: str, arg: str, value: Any, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{fn}: {arg}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{fn}: {arg} = {value}: expected >= {minimum}")
    return value


def _token_keys(fn: str, keys: Any, num_tokens: int) -> list:
    """The prompt's token keys as a list of ints in [0, 2^64), one per row,
    or [] for None."""
    if keys is None:
        return []
    import numpy as np

    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
        raise InvalidArgument(
            f"{fn}: token_keys: expected a sequence of ints or an integer array, got {type(keys).__name__}"
        )
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise InvalidArgument(
                f"{fn}: token_keys: expected a 1-D integer array, got {keys.dtype} of shape {tuple(keys.shape)}"
            )
        if keys.dtype.kind == "i" and keys.size and int(keys.min()) < 0:
            raise InvalidArgument(f"{fn}: token_keys: expected keys >= 0, got {int(keys.min())}")
        values = keys.astype(np.uint64).tolist()
    else:
        values = list(keys)
        for i, k in enumerate(values):
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise InvalidArgument(f"{fn}: token_keys[{i}]: expected an int, got {type(k).__name__}")
            if not 0 <= int(k) < 1 << 64:
                raise InvalidArgument(f"{fn}: token_keys[{i}] = {int(k)}: expected 0 <= key < 2^64")
        values = [int(k) for k in values]
    if len(values) != num_tokens:
        raise InvalidArgument(f"{fn}: token_keys: expected one key per prompt row ({num_tokens}), got {len(values)}")
    return values


class _caller_ids:
    """Prefixes the message of a C++ error with the call as the caller made
    it: the scheduler's messages speak of the engine's internal int ids."""

    def __init__(self, call: str) -> None:
        self.call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is not None and isinstance(error, (InvalidArgument, UnknownId, _core.OutOfMemory)):
            message = error.args[0] if error.args else ""
            if not str(message).startswith(("Engine.", "Engine:")):
                raise kind(f"{self.call}: {message} (internal ids)") from None
        return False


def _torch_capsules(stream: Any, arrays: tuple) -> tuple:
    """torch tensors as DLPack capsules from torch.utils.dlpack.to_dlpack, for a call on torch's current stream
    (``stream`` None); with a stream given, ``arrays`` as they are.

    The protocol's ``__dlpack_device__()`` and ``__dlpack__(stream)`` pair costs about 7 us a tensor in
    Python (four tensors, thirty layers: about 1 ms a decode step), to_dlpack well under 1 us; it orders
    nothing between streams, which a call on the producer's own stream does not need. Anything other
    than plain tensors that need no gradient is passed as given, to go through the protocol."""
    torch = sys.modules.get("torch")
    if stream is not None or torch is None:
        return arrays
    tensor = torch.Tensor
    for a in arrays:
        if a is not None and (type(a) is not tensor or a.requires_grad):
            return arrays
    to_dlpack = torch.utils.dlpack.to_dlpack
    return tuple(None if a is None else to_dlpack(a) for a in arrays)


def _library(array: Any) -> str:
    return type(array).__module__.split(".", 1)[0]


def _invariant_blocks(fn: str, batch_invariant: Any) -> int:
    """EngineConfig.batch_invariant_blocks for Engine(batch_invariant=...): False or 0: 0 (off), True: the
    default chunk, an int: that many blocks a chunk."""
    if batch_invariant is False:
        return 0
    if batch_invariant is True:
        return BATCH_INVARIANT_BLOCKS
    if not isinstance(batch_invariant, int):
        raise InvalidArgument(
            f"{fn}: batch_invariant: expected a bool or an int (blocks a chunk), got {type(batch_invariant).__name__}"
        )
    if not 0 <= batch_invariant <= 1 << 20:
        raise InvalidArgument(
            f"{fn}: batch_invariant = {batch_invariant}: expected True, False or a chunk of 0 (off) .. 2^20 blocks"
        )
    return batch_invariant


class Engine:
    """A serving engine's loop over mixkv: the continuous-batching scheduler
    and a backend holding the KV memory, on the CPU or a CUDA device.

        engine = mixkv.Engine(cache_config, num_q_heads=32, backend="cpu")
        engine.add_request("a", 120, max_new_tokens=64)        # a text prompt
        while engine.has_unfinished():
            step = engine.step()                               # memory moves applied
            for layer in range(num_layers):
                o = engine.prefill(layer, q_rows, k_rows, v_rows)  # step.prefills' rows
                out = engine.attend(layer, q, k, v)            # step.decodes' batch
            ... sample; engine.finish(request_id) on EOS ...

    ``cache_config`` (mixkv.CacheConfig) sizes the KV memory;
    ``scheduler_config`` (mixkv.SchedulerConfig) the batches; ``planner``
    (mixkv.PlannerConfig) plans the requests that come with embeddings
    (the same as ``scheduler_config.planner``; give one of them).
    ``num_q_heads`` is the model's query heads (a multiple of the cache's KV
    heads). ``backend``: "cpu" or "cuda" (mixkv built with CUDA; ``device``
    is the CUDA device). ``sm_scale``: attention scale (None: 1/sqrt(head_dim)).
    ``batch_invariant``: True makes ``attend()``'s output of a decode bitwise
    the same whatever else is in the batch and in whatever order (deterministic
    serving), by splitting each sequence's attention by its own blocks alone,
    in chunks of mixkv.engine.BATCH_INVARIANT_BLOCKS blocks (an int > 0 picks
    the chunk); steps with drafts are not covered. The CPU backend is batch-invariant
    either way. docs/python.md, "Batch-invariant decode", has the cost.

    Request ids are the caller's: str or int, unique among live requests.
    Every bad argument raises mixkv.InvalidArgument (a ValueError) or
    mixkv.UnknownId (a KeyError) naming it, and a call that raises changes
    nothing.
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        scheduler_config: Optional[SchedulerConfig] = None,
        *,
        num_q_heads: int,
        backend: Union[str, Any] = "cpu",
        planner: Optional[PlannerConfig] = None,
        device: int = 0,
        sm_scale: Optional[float] = None,
        max_blocks_per_sequence: int = 0,
        batch_invariant: Union[bool, int] = False,
    ) -> None:
        fn = "Engine"
        if _engine is None:
            raise ImportError(f"mixkv.Engine is not part of this build of mixkv ({_ENGINE_MISSING})")
        if not isinstance(cache_config, CacheConfig):
            raise InvalidArgument(
                f"{fn}: cache_config: expected a mixkv.CacheConfig, got {type(cache_config).__name__}"
            )
        if scheduler_config is None:
            scheduler_config = SchedulerConfig()
        elif not isinstance(scheduler_config, SchedulerConfig):
            raise InvalidArgument(
                f"{fn}: scheduler_config: expected a mixkv.SchedulerConfig or None, got {type(scheduler_config).__name__}"
            )
        _check_int(fn, "num_q_heads", num_q_heads, 1)
        _check_int(fn, "device", device, 0)
        _check_int(fn, "max_blocks_per_sequence", max_blocks_per_sequence, 0)
        invariant_blocks = _invariant_blocks(fn, batch_invariant)
        if isinstance(backend, str) and backend.lower() in ("cpu", "cuda"):
            kind = BackendKind.CPU if backend.lower() == "cpu" else BackendKind.CUDA
        elif isinstance(backend, BackendKind):
            kind = backend
        else:
            raise InvalidArgument(f"{fn}: backend: expected 'cpu' or 'cuda', got {backend!r}")
        if kind == BackendKind.CUDA and not _engine.built_with_cuda:
            raise InvalidArgument(
                f"{fn}: backend: 'cuda' needs mixkv built with CUDA (mixkv.built_with_cuda is False): expected 'cpu'"
            )
        if planner is not None and not isinstance(planner, PlannerConfig):
            raise InvalidArgument(
                f"{fn}: planner: expected a mixkv.PlannerConfig or None, got {type(planner).__name__}"
            )
        if planner is not None and scheduler_config.planner is not None:
            raise InvalidArgument(f"{fn}: planner: given twice (scheduler_config.planner is set too): expected one")
        if sm_scale is not None and (
            isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0
        ):
            raise InvalidArgument(f"{fn}: sm_scale = {sm_scale!r}: expected a positive number or None")
        # EngineConfig holds copies: the caller's configs stay as they were.
        config = EngineConfig(
            cache_config,
            scheduler_config,
            num_q_heads=num_q_heads,
            backend=kind,
            cuda_device=device,
            sm_scale=float(sm_scale or 0.0),
            max_blocks_per_sequence=max_blocks_per_sequence,
            batch_invariant_blocks=invariant_blocks,
        )
        if planner is not None:
            config.scheduler.planner = planner
        # No step of this class hands out decode metadata: the CUDA backend reads its device page tables and
        # the CPU backend builds the batch's own, so the scheduler's CSR copy of every held block would cost
        # O(blocks) a step for nothing.
        config.scheduler.build_metadata = False
        self._core = _engine.Engine(config)
        self._kind = kind
        self._device = device
        shape = cache_config.shape
        self._num_q_heads = num_q_heads
        self._head_dim = shape.head_dim
        self._dtype = dtype_name(shape.dtype)  # "float16" or "bfloat16": q, k, v and out
        self._ids: dict[RequestKey, int] = {}  # live caller id -> internal id
        self._keys: dict[int, RequestKey] = {}  # internal id -> caller id
        self._retired: set[RequestKey] = set()  # caller ids that have left
        self._next_id = 0
        self._decode_rows = 0  # rows of the last step's decode batch (drafts included)
        self._prefill_rows = 0  # rows of the last step's prefill chunks
        self._cache = CacheView(self, self._core.cache)

    # -- requests -------------------------------------------------------------------------------------------------
    def _internal(self, fn: str, arg: str, key: Any) -> int:
        _check_key(fn, arg, key)
        internal = self._ids.get(key)
        if internal is None:
            raise UnknownId(f"{fn}: {arg} = {key!r}: not a live request of this engine")
        return internal

    def _new_id(self, fn: str, arg: str, key: Any) -> int:
        _check_key(fn, arg, key)
        if key in self._ids:
            raise InvalidArgument(
                f"{fn}: {arg} = {key!r}: already a live request (an id can be used again once "
                "step() has reported its request finished or rejected)"
            )
        internal = self._next_id
        self._next_id += 1
        return internal

    def _bind(self, key: RequestKey, internal: int) -> None:
        self._ids[key] = internal
        self._keys[internal] = key
        self._retired.discard(key)

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
        """Queues a request. ``layout_or_num_tokens``: the prompt's TokenLayout
        (text and visual segments), or an int: a text-only prompt of that many
        tokens. With a ``plan`` (PrecisionPlan) its windows are stored as it
        says; with ``embeddings`` ([num_tokens, hidden] float32/float16/
        bfloat16, any array on the host) the planner plans them; with neither
        the prompt is stored FP16. ``arrival_time`` (None: time.monotonic())
        orders admission. ``token_keys`` (prefix caching, CacheConfig.
        prefix_cache): one non-negative 64-bit key per prompt row, a text
        token's id or the engine's hash of a visual token's embedding (an int
        sequence or integer array); a prompt whose leading blocks match cached
        ones shares them and its first prefill chunk starts after them
        (``status(request_id).cached_tokens``). A request that can never fit
        is reported in the next step's ``rejected``."""
        fn = "Engine.add_request"
        internal = self._new_id(fn, "request_id", request_id)
        if isinstance(layout_or_num_tokens, TokenLayout):
            layout = layout_or_num_tokens
        elif isinstance(layout_or_num_tokens, int) and not isinstance(layout_or_num_tokens, bool):
            _check_int(fn, "layout_or_num_tokens", layout_or_num_tokens, 1)
            layout = TokenLayout([Segment(TokenKind.Text, layout_or_num_tokens)])
        else:
            raise InvalidArgument(
                f"{fn}: layout_or_num_tokens: expected a mixkv.TokenLayout or a number of text "
                f"tokens, got {type(layout_or_num_tokens).__name__}"
            )
        if plan is not None and not isinstance(plan, PrecisionPlan):
            raise InvalidArgument(f"{fn}: plan: expected a mixkv.PrecisionPlan or None, got {type(plan).__name__}")
        _check_int(fn, "max_new_tokens", max_new_tokens, 1)
        _check_int(fn, "priority", priority)
        keys = _token_keys(fn, token_keys, layout.num_tokens)
        if arrival_time is None:
            arrival_time = time.monotonic()
        elif isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
            raise InvalidArgument(f"{fn}: arrival_time: expected a number or None, got {type(arrival_time).__name__}")
        with _caller_ids(f"{fn}(request_id={request_id!r})"):
            self._core.add_request(
                internal,
                layout,
                plan=plan,
                embeddings=embeddings,
                max_new_tokens=max_new_tokens,
                priority=priority,
                arrival_time=float(arrival_time),
                token_keys=keys,
            )
        self._bind(request_id, internal)

    def fork(self, parent_id: RequestKey, child_id: RequestKey, max_new_tokens: Optional[int] = None) -> None:
        """Parallel sampling (n > 1): ``child_id`` becomes a running request
        that shares every block of the running ``parent_id`` and decodes from
        the next step on, ``max_new_tokens`` more tokens (None: as many as the
        parent has left). Its generated count starts at the parent's."""
        fn = "Engine.fork"
        parent = self._internal(fn, "parent_id", parent_id)
        child = self._new_id(fn, "child_id", child_id)
        if max_new_tokens is not None:
            _check_int(fn, "max_new_tokens", max_new_tokens, 1)
        with _caller_ids(f"{fn}(parent_id={parent_id!r}, child_id={child_id!r})"):
            self._core.fork(parent, child, -1 if max_new_tokens is None else max_new_tokens)
        self._bind(child_id, child)

    def speculate(self, request_id: RequestKey, num_drafts: int) -> None:
        """Speculative decoding: ``request_id`` gets ``num_drafts`` draft
        rows in its next decode step instead of the scheduler config's
        ``num_speculative_tokens`` (the steps after use that default again).
        Drafts are capped by the tokens the request has left, the step's
        token budget and free memory: a step may give fewer, or none. The
        step's ``decode_rows`` says how many it got."""
        fn = "Engine.speculate"
        internal = self._internal(fn, "request_id", request_id)
        _check_int(fn, "num_drafts", num_drafts, 0)
        with _caller_ids(f"{fn}(request_id={request_id!r}, num_drafts={num_drafts!r})"):
            self._core.speculate(internal, num_drafts)

    def accept(self, request_id: RequestKey, num_accepted: int) -> None:
        """After verifying the last step's drafts of ``request_id``: its first
        ``num_accepted`` drafts (0 .. ``status(request_id).drafts``) were
        accepted. The rejected ones leave the cache, and the step counts
        ``num_accepted + 1`` generated tokens: the accepted drafts, then the
        token sampled after them, whose K/V the next step's first row of
        the request brings. Drafts not accepted before the next ``step()``
        are all rejected there."""
        fn = "Engine.accept"
        internal = self._internal(fn, "request_id", request_id)
        _check_int(fn, "num_accepted", num_accepted, 0)
        with _caller_ids(f"{fn}(request_id={request_id!r}, num_accepted={num_accepted!r})"):
            self._core.accept(internal, num_accepted)

    def _end(self, fn: str, request_id: RequestKey, call) -> bool:
        _check_key(fn, "request_id", request_id)
        internal = self._ids.get(request_id)
        if internal is None:
            if request_id in self._retired:
                return False
            raise UnknownId(f"{fn}: request_id = {request_id!r}: never added to this engine")
        return call(internal)

    def finish(self, request_id: RequestKey) -> bool:
        """Ends a request (EOS, stop string): frees what it holds; reported in
        the next step's ``finished`` as Stopped. False when it has already
        left; UnknownId for an id never added."""
        return self._end("Engine.finish", request_id, self._core.finish)

    def cancel(self, request_id: RequestKey) -> bool:
        """Cancels a request in any state; reported in the next step's
        ``finished`` as Cancelled. False when it has already left."""
        return self._end("Engine.cancel", request_id, self._core.cancel)

    def has_unfinished(self) -> bool:
        """Live requests, or reports still to come out of step()."""
        return self._core.has_unfinished()

    def __contains__(self, request_id: Any) -> bool:
        """Whether ``request_id`` is live (added, not yet reported finished or rejected)."""
        return not isinstance(request_id, bool) and isinstance(request_id, (str, int)) and request_id in self._ids

    def status(self, request_id: RequestKey):
        """A live request's progress (mixkv.RequestStatus); state Finished for
        one ended (finish, cancel, its last token) whose report comes with the
        next step."""
        return self._core.status(self._internal("Engine.status", "request_id", request_id))

    def stats(self):
        """The scheduler's queue sizes and counters (mixkv.SchedulerStats)."""
        return self._core.stats()

    # -- the step -------------------------------------------------------------------------------------------------
    def _stream(self, fn: str, stream: Any) -> int:
        """The cudaStream_t the CUDA backend enqueues on: ``stream`` (an int, a
        torch.cuda.Stream or a cupy.cuda.Stream), else torch's current stream
        when torch is imported, else CuPy's, else the legacy default (0)."""
        if self._kind != BackendKind.CUDA:
            return 0
        if stream is None:
            modules = sys.modules
            if "torch" in modules:
                return int(modules["torch"].cuda.current_stream(self._device).cuda_stream)
            if "cupy" in modules:
                return int(modules["cupy"].cuda.get_current_stream().ptr)
            return 0
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        for attribute in ("cuda_stream", "ptr"):
            if hasattr(stream, attribute):
                return int(getattr(stream, attribute))
        raise InvalidArgument(
            f"{fn}: stream: expected None, an int (cudaStream_t), a torch.cuda.Stream or a "
            f"cupy.cuda.Stream, got {type(stream).__name__}"
        )

    def step(self, *, stream: Any = None) -> EngineStep:
        """Schedules the next step and applies its memory moves (demotions,
        swaps, copy-on-write copies, page tables, the decode plan; on the CUDA
        backend enqueued on ``stream``). Returns what the model runs."""
        raw = self._core.step(self._stream("Engine.step", stream))
        result = EngineStep(raw, self._keys.__getitem__)
        for key in [f.request_id for f in result.finished] + [r.request_id for r in result.rejected]:
            internal = self._ids.pop(key, None)
            if internal is not None:
                del self._keys[internal]
                self._retired.add(key)
        self._decode_rows = result.num_decode_rows
        self._prefill_rows = result.prefill_rows
        return result

    def store(self, layer: int, k: Any, v: Any, *, stream: Any = None) -> None:
        """One layer's K and V of the step's prefill rows, the chunks'
        rows concatenated in ``step.prefills`` order: [prefill_rows,
        num_kv_heads, head_dim] arrays of the cache's dtype (float16, or
        bfloat16 for ``CacheShape(dtype=DType.BF16)``) on the engine's device.
        For an engine that ran its own prefill attention; ``prefill`` does
        both. Per layer, call ``prefill`` or ``store``, not both."""
        s = self._stream("Engine.store", stream)
        self._core.store(layer, *_torch_capsules(stream, (k, v)), s)

    def attend(
        self, layer: int, q: Any, k: Any, v: Any, out: Any = None, lse: Any = None, *, stream: Any = None
    ) -> Any:
        """One layer of the decode batch: appends k, v ([rows, num_kv_heads,
        head_dim] of the cache's dtype, float16 or bfloat16, as every array
        here but lse) as the batch's newest tokens, then attends q
        ([rows, num_q_heads, head_dim]) over each request's tokens in
        every pool. ``rows`` is ``step.num_decode_rows``: one row a request
        of ``step.decodes``, or, when the step has draft tokens, the rows of
        ``step.decode_rows`` (each request's last sampled token, then its
        drafts, attending causally to each other). Writes and returns
        ``out`` ([rows, num_q_heads, head_dim]; allocated like q,
        with q's library and device, when not given) and, when given,
        ``lse`` (float32 [rows, num_q_heads], the natural-log sum of
        exponentials of the scaled scores)."""
        s = self._stream("Engine.attend", stream)
        if out is None:
            out = self._empty_like(q, self._decode_rows, "Engine.attend")
        self._core.attend(layer, *_torch_capsules(stream, (q, k, v, out, lse)), s)
        return out

    def prefill(
        self, layer: int, q: Any, k: Any, v: Any, out: Any = None, lse: Any = None, *, stream: Any = None
    ) -> Any:
        """One layer of the step's prefill chunks, attention through the
        cache: each chunk's rows (q [rows, num_q_heads, head_dim] of the
        cache's dtype, k
        and v [rows, num_kv_heads, head_dim], the chunks' rows concatenated
        in ``step.prefills`` order) attend to every prompt row stored before
        the chunk, at the precision it was stored in, and causally to each
        other; then k and v are stored as ``store`` stores them. The engine
        keeps no copy of the prompt. Writes and returns ``out`` (the cache's
        dtype, [rows, num_q_heads, head_dim], allocated like q when not given) and,
        when given, ``lse`` (float32 [rows, num_q_heads]). Per layer, call
        ``prefill`` or ``store``, not both."""
        s = self._stream("Engine.prefill", stream)
        if out is None:
            out = self._empty_like(q, self._prefill_rows, "Engine.prefill")
        self._core.prefill(layer, *_torch_capsules(stream, (q, k, v, out, lse)), s)
        return out

    def _empty_like(self, q: Any, rows: int, fn: str) -> Any:
        shape = (rows, self._num_q_heads, self._head_dim)
        library = _library(q)
        if library == "torch":
            import torch

            return torch.empty(shape, dtype=getattr(torch, self._dtype), device=q.device)
        if library == "cupy" and self._dtype == "float16":
            import cupy

            with cupy.cuda.Device(q.device.id):
                return cupy.empty(shape, dtype=cupy.float16)
        if (library == "numpy" or self._kind == BackendKind.CPU) and self._dtype == "float16":
            import numpy

            return numpy.empty(shape, dtype=numpy.float16)
        raise InvalidArgument(
            f"{fn}: out: cannot allocate an output like q ({type(q).__name__}) in the cache's dtype "
            f"{self._dtype}: pass out= ({self._dtype} [rows, num_q_heads, head_dim] on the engine's device"
            + ("; NumPy and CuPy have no bfloat16: torch.bfloat16 tensors do)" if self._dtype == "bfloat16" else ")")
        )

    def synchronize(self) -> None:
        """Waits until everything enqueued so far has finished (CPU: returns at once)."""
        self._core.synchronize()

    # -- inspection -----------------------------------------------------------------------------------------------
    @property
    def cache(self) -> CacheView:
        """The cache manager, read only (pool statistics, each request's blocks)."""
        return self._cache

    @property
    def backend(self) -> str:
        """'cpu' or 'cuda'."""
        return "cuda" if self._kind == BackendKind.CUDA else "cpu"

    @property
    def device(self) -> int:
        """The CUDA device (0 on the CPU backend)."""
        return self._device

    @property
    def num_q_heads(self) -> int:
        return self._num_q_heads

    @property
    def batch_invariant_blocks(self) -> int:
        """Batch-invariant decode's chunk in blocks; 0: off."""
        return self._core.config.batch_invariant_blocks

    @property
    def config(self):
        """A copy of the engine's configuration (mixkv.engine.EngineConfig)."""
        return self._core.config

    def check_invariants(self) -> None:
        """The cache's and the scheduler's invariants, and that every live
        request id maps to a request the scheduler knows. Raises
        mixkv.InvariantViolation naming the first broken one."""
        self._core.check_invariants()
        if len(self._ids) != len(self._keys):
            raise InvariantViolation(f"Engine: {len(self._ids)} live request ids but {len(self._keys)} internal ids")
        for key, internal in self._ids.items():
            if self._keys.get(internal) != key:
                raise InvariantViolation(
                    f"Engine: request id {key!r} maps to internal id {internal}, which maps back "
                    f"to {self._keys.get(internal)!r}"
                )
            if not self._core.contains(internal):
                raise InvariantViolation(f"Engine: request id {key!r} is live here but unknown to the scheduler")

    def describe_state(self) -> str:
        """Canonical text of the scheduler's queues and the cache's books (internal ids)."""
        return self._core.describe_state()

    def step_digest(self) -> int:
        """A 64-bit digest of the last step() (every id, slot, block id,
        demotion, swap and copy, the decode metadata, the page lists of the
        requests whose lists changed other than by an append) and of the
        pools' block counts now, so call it right after step(); 0 before
        the first. Engines that took the same decisions over caches of the same
        geometry give the same digest (mixkv.tp compares the ranks')."""
        return self._core.step_digest()

    def __repr__(self) -> str:
        return (
            f"mixkv.Engine(backend={self.backend!r}, device={self._device}, live requests={len(self._ids)}, "
            f"num_q_heads={self._num_q_heads})"
        )
