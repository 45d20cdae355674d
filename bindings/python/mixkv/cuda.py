"""The CUDA backend: DeviceKVCache (a manager with a device arena),
DevicePageTables, DecodePlan (plan once per step, run per layer) and
CudaWindowPlanner.

Importing this module raises ImportError when mixkv was built without CUDA
(``mixkv.built_with_cuda`` is False).
"""

from . import _core

if not _core.built_with_cuda:
    raise ImportError("mixkv was built without CUDA (MIXKV_CUDA=OFF): mixkv.cuda is not available")

_cuda = _core.cuda
DeviceBytes = _cuda.DeviceBytes
DeviceKVCache = _cuda.DeviceKVCache
PageTableConfig = _cuda.PageTableConfig
DevicePageTables = _cuda.DevicePageTables
LayerSharing = _cuda.LayerSharing
DecodePlanConfig = _cuda.DecodePlanConfig
DecodePlan = _cuda.DecodePlan
DeviceStoreMapping = _cuda.DeviceStoreMapping
CudaWindowPlanner = _cuda.CudaWindowPlanner
layer_sensitivity = _cuda.layer_sensitivity
device_available = _cuda.device_available

__all__ = [
    "DeviceBytes",
    "DeviceKVCache",
    "PageTableConfig",
    "DevicePageTables",
    "LayerSharing",
    "DecodePlanConfig",
    "DecodePlan",
    "DeviceStoreMapping",
    "CudaWindowPlanner",
    "layer_sensitivity",
    "device_available",
]
