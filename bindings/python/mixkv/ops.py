"""Cache operations.

Each takes the cache first and dispatches on it: a ``mixkv.KVCache`` with NumPy
arrays (CPU backend), a ``mixkv.cuda.DeviceKVCache`` with CUDA arrays from
torch or CuPy (``__cuda_array_interface__``, no copies, on the caller's
stream). ``demote`` exists only when mixkv was built with CUDA: the C++ CPU
backend has no demote.
"""

from . import _core

store_prefill = _core.ops.store_prefill
append = _core.ops.append
copy_blocks = _core.ops.copy_blocks
paged_decode_attention = _core.ops.paged_decode_attention
merge_states = _core.ops.merge_states
read_head = _core.ops.read_head

__all__ = ["store_prefill", "append", "copy_blocks", "paged_decode_attention", "merge_states", "read_head"]

if _core.built_with_cuda:
    demote = _core.ops.demote
    __all__.append("demote")
