"""mixkv: a paged KV cache with per-block precision (FP16/INT4/INT2 pools).

The package mirrors the C++ API (docs/python.md): the cache configuration, the
manager, the WindowQuant planner and, in ``mixkv.ops``, the operations that
store and read KV bytes. ``mixkv.KVCache`` is the CPU backend's cache (NumPy
arrays); ``mixkv.cuda.DeviceKVCache`` the CUDA backend's (torch or CuPy
tensors), present when mixkv was built with CUDA (``mixkv.built_with_cuda``).

C++ errors arrive as subclasses of the built-in exceptions, with the C++
message: InvalidArgument (ValueError), OutOfMemory (MemoryError), UnknownId
(KeyError), IndexOutOfRange (IndexError), InvariantViolation and DeviceError
(RuntimeError).
"""

from ._core import (
    AppendResult,
    BatchPolicy,
    BlockCopy,
    BlockFormat,
    CacheConfig,
    CacheShape,
    DecodeMetadata,
    DeviceError,
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
    Segment,
    SensitivityReduction,
    StoreMapping,
    TokenKind,
    TokenLayout,
    UnknownId,
    WindowPlanner,
    WindowSlot,
    bits_of,
    built_with_cuda,
    bytes_per_token_per_head,
    is_quantized,
    layer_sensitivity,
    majority_vote,
    plan_stats,
    window_similarity,
)
from . import ops

__version__ = "0.1.0"

__all__ = [
    "AppendResult",
    "BatchPolicy",
    "BlockCopy",
    "BlockFormat",
    "CacheConfig",
    "CacheShape",
    "DecodeMetadata",
    "DeviceError",
    "IndexOutOfRange",
    "InvalidArgument",
    "InvariantViolation",
    "KVCache",
    "KVCacheManager",
    "LayerThresholds",
    "OutOfMemory",
    "PagedPoolTable",
    "PlannerConfig",
    "PlanStats",
    "PoolStats",
    "Precision",
    "PrecisionPlan",
    "Segment",
    "SensitivityReduction",
    "StoreMapping",
    "TokenKind",
    "TokenLayout",
    "UnknownId",
    "WindowPlanner",
    "WindowSlot",
    "bits_of",
    "built_with_cuda",
    "bytes_per_token_per_head",
    "is_quantized",
    "layer_sensitivity",
    "majority_vote",
    "ops",
    "plan_stats",
    "window_similarity",
]
