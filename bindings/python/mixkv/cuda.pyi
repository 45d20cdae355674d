# Type stubs of mixkv.cuda (present when mixkv.built_with_cuda).
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
import numpy.typing as npt

from ._core import (
    CacheConfig,
    KVCacheManager,
    PlannerConfig,
    Precision,
    PrecisionPlan,
    SensitivityReduction,
    StoreMapping,
    TokenLayout,
)

Stream = int | Any | None
_Indices = npt.NDArray[np.int32] | Sequence[SupportsIndex]

__all__: list[str]

def device_available() -> bool: ...

class DeviceBytes:
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class DeviceKVCache(KVCacheManager):
    def __init__(self, config: CacheConfig) -> None: ...
    @property
    def device(self) -> int: ...
    @property
    def arena(self) -> DeviceBytes: ...
    @property
    def swap(self) -> npt.NDArray[np.uint8] | None: ...
    def check_status(self, stream: Stream = None) -> None: ...

class PageTableConfig:
    num_layers: int
    max_sequences: int
    max_blocks_per_sequence: int
    pool_blocks: list[int] | None
    def __init__(
        self,
        num_layers: int,
        max_sequences: int,
        max_blocks_per_sequence: int,
        pool_blocks: Sequence[int] | None = None,
    ) -> None: ...

class DevicePageTables:
    def __init__(self, config: PageTableConfig, cache: KVCacheManager | None = None) -> None: ...
    @property
    def config(self) -> PageTableConfig: ...
    def set_blocks(self, slot: int, layer: int, pool: Precision, blocks: _Indices, last_block_len: int = 0) -> None: ...
    def sync(self, slot: int, manager: KVCacheManager, id: int) -> None: ...
    def clear(self, slot: int) -> None: ...
    def pending_updates(self) -> int: ...
    def upload(self, stream: Stream = None) -> int: ...
    def num_blocks(self, slot: int, layer: int, pool: Precision) -> int: ...
    def fp16_fill(self, slot: int, layer: int) -> int: ...
    def blocks(self, slot: int, layer: int, pool: Precision) -> npt.NDArray[np.int32]: ...

class DecodePlanConfig:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_batch: int
    max_items_per_layer: int
    num_sms: int
    chunks_per_sequence: int
    max_heads_per_item: int
    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_batch: int,
        max_items_per_layer: int = 0,
        num_sms: int = 0,
        chunks_per_sequence: int = 0,
        max_heads_per_item: int = 0,
    ) -> None: ...

class DecodePlan:
    def __init__(self, config: DecodePlanConfig, tables: DevicePageTables) -> None: ...
    def plan(self, slots: _Indices, stream: Stream = None) -> None: ...
    @property
    def config(self) -> DecodePlanConfig: ...
    @property
    def batch_size(self) -> int: ...
    def num_items(self, layer: int) -> int: ...
    def num_split_items(self, layer: int) -> int: ...
    def bytes_read(self, layer: int) -> int: ...

class DeviceStoreMapping:
    def __init__(self) -> None: ...
    def upload(
        self, mapping: StoreMapping, block_size: int, stream: Stream = None, cache: KVCacheManager | None = None
    ) -> None: ...
    @property
    def rows(self) -> int: ...

class CudaWindowPlanner:
    def __init__(self, config: PlannerConfig) -> None: ...
    @property
    def config(self) -> PlannerConfig: ...
    @property
    def num_layers(self) -> int: ...
    def plan(
        self, layouts: Sequence[TokenLayout], embeddings: Sequence[Any], stream: Stream = None
    ) -> list[PrecisionPlan]: ...
    def prepare(self, layouts: Sequence[TokenLayout], embeddings: Sequence[Any], stream: Stream = None) -> None: ...
    def launch(self, stream: Stream = None) -> None: ...
    def finish(self, stream: Stream = None) -> list[PrecisionPlan]: ...

def layer_sensitivity(
    before: Sequence[Any],
    after: Sequence[Any],
    reduction: SensitivityReduction = SensitivityReduction.Flattened,
    stream: Stream = None,
) -> list[float]: ...
