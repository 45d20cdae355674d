#pragma once
// The CUDA kernels that interpret 16-bit values (store_prefill's quantizer,
// demote, decode and extend attention) are built for FP16 caches only; a
// BF16 cache's bits read as FP16 would be wrong values, so its pools are
// refused before anything is enqueued. Byte copies (append, copy_blocks,
// swap_blocks) move either type unchanged and take both.
#include <string>

#include "mixkv/core/errors.h"
#include "mixkv/core/pool_view.h"

namespace mixkv::gpu::detail {

inline void require_fp16_pool(const char* fn, const std::string& name, const PoolView& pool) {
  if (pool.format.dtype != DType::F16) {
    throw InvalidArgument(std::string(fn) + ": " + name + ".format.dtype = " + to_string(pool.format.dtype) +
                          ": expected float16 (the CUDA kernels of this build take FP16 caches; a BF16 cache runs "
                          "on the CPU backend)");
  }
}

inline void require_fp16_pools(const char* fn, const PoolViews& pools) {
  for (Precision p : kAllPrecisions) {
    require_fp16_pool(fn, "pools[" + std::string(to_string(p)) + "]", pools[pool_index(p)]);
  }
}

}  // namespace mixkv::gpu::detail
