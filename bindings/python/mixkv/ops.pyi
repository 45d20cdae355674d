# Type stubs of mixkv.ops: each operation has a CPU form (mixkv.KVCache, NumPy
# arrays) and, when mixkv is built with CUDA, a CUDA form (DeviceKVCache,
# arrays exporting __cuda_array_interface__, an optional stream).
import enum
from collections.abc import Sequence
from typing import Any, Protocol, SupportsIndex, overload

import numpy as np
import numpy.typing as npt

from ._core import (
    BlockCopy,
    BlockFormat,
    DecodeMetadata,
    DemoteOp,
    KVCache,
    PagedPoolTable,
    Precision,
    StoreMapping,
    SwapCopy,
)
from .cuda import DecodePlan, DeviceKVCache, DeviceStoreMapping

class CudaArray(Protocol):
    """torch / CuPy / Numba device arrays."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

# None: torch's current stream if torch is imported, else CuPy's, else the
# legacy default stream; or an int (cudaStream_t), a torch.cuda.Stream, a cupy.cuda.Stream.
Stream = int | Any | None

_F16 = npt.NDArray[np.float16]
_F32 = npt.NDArray[np.float32]
_Indices = npt.NDArray[np.int32] | Sequence[SupportsIndex]

__all__: list[str]

@overload
def store_prefill(cache: KVCache, k: _F16, v: _F16, mapping: StoreMapping) -> None: ...
@overload
def store_prefill(
    cache: DeviceKVCache, k: CudaArray, v: CudaArray, mapping: DeviceStoreMapping, *, stream: Stream = None
) -> None: ...
@overload
def append(cache: KVCache, k: _F16, v: _F16, slots: _Indices) -> None: ...
@overload
def append(cache: DeviceKVCache, k: CudaArray, v: CudaArray, slots: CudaArray, *, stream: Stream = None) -> None: ...
@overload
def copy_blocks(cache: KVCache, copies: Sequence[BlockCopy], precision: Precision = Precision.FP16) -> None: ...
@overload
def copy_blocks(
    cache: DeviceKVCache, copies: CudaArray, precision: Precision = Precision.FP16, *, stream: Stream = None
) -> None: ...
@overload
def paged_decode_attention(
    cache: KVCache,
    metadata: DecodeMetadata,
    layer: int,
    q: _F16,
    *,
    sm_scale: float | None = None,
    out: _F32 | None = None,
    lse: _F32 | None = None,
) -> tuple[_F32, _F32]: ...
@overload
def paged_decode_attention(
    cache: KVCache,
    metadata: list[PagedPoolTable],
    layer: int,
    q: _F16,
    *,
    sm_scale: float | None = None,
    out: _F32 | None = None,
    lse: _F32 | None = None,
) -> tuple[_F32, _F32]: ...
@overload
def paged_decode_attention(
    cache: DeviceKVCache,
    plan: DecodePlan,
    layer: int,
    q: CudaArray,
    *,
    out: CudaArray,
    lse: CudaArray | None = None,
    sm_scale: float | None = None,
    fixed_grid: bool = False,
    stream: Stream = None,
) -> tuple[CudaArray, CudaArray | None]: ...
@overload
def merge_states(
    out_a: _F32, lse_a: _F32, out_b: _F32, lse_b: _F32, *, out: _F32 | None = None, lse: _F32 | None = None
) -> tuple[_F32, _F32]: ...
@overload
def merge_states(
    out_a: CudaArray,
    lse_a: CudaArray,
    out_b: CudaArray,
    lse_b: CudaArray,
    *,
    out: CudaArray,
    lse: CudaArray,
    stream: Stream = None,
) -> tuple[CudaArray, CudaArray]: ...
def read_head(format: BlockFormat, head_region: npt.NDArray[np.uint8]) -> tuple[_F32, _F32]: ...
@overload
def demote(cache: KVCache, ops: Sequence[DemoteOp]) -> None: ...
@overload
def demote(
    cache: DeviceKVCache, moves: CudaArray, src: Precision, dst: Precision, *, stream: Stream = None
) -> None: ...

class SwapDirection(enum.IntEnum):
    DeviceToHost = 0
    HostToDevice = 1

@overload
def swap_blocks(cache: KVCache, copies: Sequence[SwapCopy], direction: SwapDirection) -> None: ...
@overload
def swap_blocks(
    cache: DeviceKVCache, copies: Sequence[SwapCopy], direction: SwapDirection, *, stream: Stream = None
) -> None: ...
