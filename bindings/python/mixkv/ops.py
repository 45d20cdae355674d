"""Cache operations.

Each takes the cache first and dispatches on it: a ``mixkv.KVCache`` with NumPy
arrays (CPU backend), a ``mixkv.cuda.DeviceKVCache`` with CUDA arrays from
torch or CuPy (``__cuda_array_interface__``, no copies, on the caller's
stream). ``swap_blocks`` moves blocks between the arena and the cache's host
swap pool: plain host memory on the CPU backend, pinned host memory
(``DeviceKVCache.swap``) copied by one kernel launch on the CUDA backend.
"""

from . import _core

store_prefill = _core.ops.store_prefill
append = _core.ops.append
copy_blocks = _core.ops.copy_blocks
paged_decode_attention = _core.ops.paged_decode_attention
merge_states = _core.ops.merge_states
read_head = _core.ops.read_head
demote = _core.ops.demote
swap_blocks = _core.ops.swap_blocks
SwapDirection = _core.ops.SwapDirection

__all__ = [
    "store_prefill",
    "append",
    "copy_blocks",
    "paged_decode_attention",
    "merge_states",
    "read_head",
    "demote",
    "swap_blocks",
    "SwapDirection",
]
