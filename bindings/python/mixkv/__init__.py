"""mixkv: a paged KV cache with per-block precision (FP16/INT4/INT2 pools).

The package mirrors the C++ API (docs/python.md): the cache configuration, the
manager, the WindowQuant planner, the continuous-batching scheduler and, in
``mixkv.ops``, the operations that store and read KV bytes. ``mixkv.KVCache`` is the CPU backend's cache (NumPy
arrays); ``mixkv.cuda.DeviceKVCache`` the CUDA backend's (torch or CuPy
tensors), present when mixkv was built with CUDA (``mixkv.built_with_cuda``).

C++ errors arrive as subclasses of the built-in exceptions, with the C++
message: InvalidArgument (ValueError), OutOfMemory (MemoryError), UnknownId
(KeyError), IndexOutOfRange (IndexError), InvariantViolation and DeviceError
(RuntimeError).
"""

from . import ops
from ._core import (
    AgeTierPolicy,
    AppendResult,
    AppendSlots,
    BatchPolicy,
    BlockCopy,
    BlockFormat,
    BudgetedPlan,
    CacheConfig,
    CacheShape,
    DecodeMetadata,
    DemoteOp,
    Demotion,
    DeviceError,
    DType,
    FinishedRequest,
    FinishReason,
    IndexOutOfRange,
    InvalidArgument,
    InvariantViolation,
    KVCache,
    KVCacheManager,
    LayerThresholds,
    OutOfMemory,
    PagedPoolTable,
    PlannerConfig,
    PlanStats,
    PoolStats,
    Precision,
    PrecisionPlan,
    PreemptionMode,
    PrefillChunk,
    PrefillMode,
    PrefixCacheConfig,
    PrefixCacheStats,
    PrefixHigher,
    PrefixIdentity,
    RejectedRequest,
    Request,
    RequestState,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    SchedulingPolicy,
    ScoreBudgetConfig,
    ScoredBudgetPlan,
    Segment,
    SensitivityReduction,
    StepOutput,
    StoreMapping,
    SwapCopy,
    TokenKind,
    TokenLayout,
    UnknownId,
    WindowPlanner,
    WindowSlot,
    bits_of,
    built_with_cuda,
    bytes_per_token_per_head,
    dtype_name,
    floor_layers_within_budget,
    is_quantized,
    layer_sensitivity,
    majority_vote,
    plan_from_layer_scores_within_budget,
    plan_stats,
    window_similarity,
)

# mixkv.Engine: the scheduler and a backend behind one object (engine.py).
from .engine import BackendKind, CacheView, Engine, EngineStep, Finished, Prefill, Rejected

__version__ = "0.1.0"

# Every public name above, listed once: the imports are the list.
__all__ = sorted(name for name in globals() if not name.startswith("_") and name != "engine")
