import enum
from typing import Any, NamedTuple, Optional, Sequence, Union

from ._core import (
    BlockFormat,
    CacheConfig,
    FinishReason,
    PlannerConfig,
    PoolStats,
    Precision,
    PrecisionPlan,
    PrefixCacheStats,
    RequestStatus,
    SchedulerConfig,
    SchedulerStats,
    TokenLayout,
)

RequestKey = Union[str, int]
# Any array exporting __dlpack__ (NumPy, torch, CuPy), __cuda_array_interface__
# or the buffer protocol.
Array = Any
# None, an int (cudaStream_t), a torch.cuda.Stream or a cupy.cuda.Stream.
Stream = Any

__all__: list[str]

class BackendKind(enum.IntEnum):
    CPU = 0
    CUDA = 1

BATCH_INVARIANT_BLOCKS: int

class EngineConfig:
    cache: CacheConfig
    scheduler: SchedulerConfig
    num_q_heads: int
    backend: BackendKind
    cuda_device: int
    sm_scale: float
    max_blocks_per_sequence: int
    batch_invariant_blocks: int
    def __init__(
        self,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        *,
        num_q_heads: int,
        backend: BackendKind = ...,
        cuda_device: int = 0,
        sm_scale: float = 0.0,
        max_blocks_per_sequence: int = 0,
        batch_invariant_blocks: int = 0,
    ) -> None: ...

class Prefill(NamedTuple):
    request_id: RequestKey
    start: int
    end: int
    last: bool

class Finished(NamedTuple):
    request_id: RequestKey
    reason: FinishReason
    generated: int
    note: str

class Rejected(NamedTuple):
    request_id: RequestKey
    reason: str

class EngineStep:
    step: int
    prefills: list[Prefill]
    prefill_rows: int
    decodes: list[RequestKey]
    decode_rows: list[int]
    num_decode_rows: int
    finished: list[Finished]
    rejected: list[Rejected]
    swapped_out: list[RequestKey]
    swapped_in: list[RequestKey]
    preempted: list[RequestKey]
    num_batched_tokens: int
    demotions: int
    age_demotions: int
    swap_out_blocks: int
    swap_in_blocks: int
    copies: int

class CacheView:
    @property
    def config(self) -> CacheConfig: ...
    @property
    def total_slabs(self) -> int: ...
    @property
    def free_slabs(self) -> int: ...
    def format(self, precision: Precision) -> BlockFormat: ...
    def pool_stats(self, precision: Precision) -> PoolStats: ...
    def prefix_stats(self) -> PrefixCacheStats: ...
    def demand(self, layout: TokenLayout, plan: PrecisionPlan) -> list[int]: ...
    def can_allocate(self, blocks: list[int]) -> bool: ...
    def holds(self, request_id: RequestKey) -> bool: ...
    def num_tokens(self, request_id: RequestKey) -> int: ...
    def plan(self, request_id: RequestKey) -> PrecisionPlan: ...
    def blocks(self, request_id: RequestKey, layer: int, precision: Precision) -> Any: ...
    def blocks_held(self, request_id: RequestKey) -> list[int]: ...
    def is_swapped(self, request_id: RequestKey) -> bool: ...
    def free_swap_slots(self) -> list[int]: ...
    def check_invariants(self) -> None: ...
    def describe_state(self) -> str: ...

class Engine:
    def __init__(
        self,
        cache_config: CacheConfig,
        scheduler_config: Optional[SchedulerConfig] = None,
        *,
        num_q_heads: int,
        backend: Union[str, BackendKind] = "cpu",
        planner: Optional[PlannerConfig] = None,
        device: int = 0,
        sm_scale: Optional[float] = None,
        max_blocks_per_sequence: int = 0,
        batch_invariant: Union[bool, int] = False,
    ) -> None: ...
    @property
    def batch_invariant_blocks(self) -> int: ...
    def add_request(
        self,
        request_id: RequestKey,
        layout_or_num_tokens: Union[TokenLayout, int],
        *,
        plan: Optional[PrecisionPlan] = None,
        embeddings: Optional[Array] = None,
        max_new_tokens: int,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        token_keys: Optional[Union[Sequence[int], Array]] = None,
    ) -> None: ...
    def fork(self, parent_id: RequestKey, child_id: RequestKey, max_new_tokens: Optional[int] = None) -> None: ...
    def speculate(self, request_id: RequestKey, num_drafts: int) -> None: ...
    def accept(self, request_id: RequestKey, num_accepted: int) -> None: ...
    def finish(self, request_id: RequestKey) -> bool: ...
    def cancel(self, request_id: RequestKey) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def __contains__(self, request_id: object) -> bool: ...
    def status(self, request_id: RequestKey) -> RequestStatus: ...
    def stats(self) -> SchedulerStats: ...
    def step(self, *, stream: Stream = None) -> EngineStep: ...
    def store(self, layer: int, k: Array, v: Array, *, stream: Stream = None) -> None: ...
    def attend(
        self,
        layer: int,
        q: Array,
        k: Array,
        v: Array,
        out: Optional[Array] = None,
        lse: Optional[Array] = None,
        *,
        stream: Stream = None,
    ) -> Array: ...
    def prefill(
        self,
        layer: int,
        q: Array,
        k: Array,
        v: Array,
        out: Optional[Array] = None,
        lse: Optional[Array] = None,
        *,
        stream: Stream = None,
    ) -> Array: ...
    def synchronize(self) -> None: ...
    @property
    def cache(self) -> CacheView: ...
    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def config(self) -> EngineConfig: ...
    def check_invariants(self) -> None: ...
    def describe_state(self) -> str: ...
    def step_digest(self) -> int: ...
