#pragma once
// The 16-bit type checks of the CUDA ops that interpret values (store_prefill,
// demote, decode and extend attention): every pool an op reads or writes
// holds the same cache type (FP16 or BF16), and every 16-bit array it is
// given is of that type. A mismatch would reinterpret one type's bits as
// the other's, so it is refused before anything is enqueued. Byte copies
// (append's rows, copy_blocks, swap_blocks) move either type unchanged;
// append still checks its rows' type against the pool.
#include <string>

#include "mixkv/core/dtype.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/pool_view.h"

namespace mixkv::gpu::detail {

// The pool's dtype, which must be F16 or BF16; InvalidArgument naming it
// otherwise.
inline DType require_cache_dtype(const char* fn, const std::string& name, const PoolView& pool) {
  if (!is_cache_dtype(pool.format.dtype)) {
    throw InvalidArgument(std::string(fn) + ": " + name + ".format.dtype = " + to_string(pool.format.dtype) +
                          ": expected float16 or bfloat16");
  }
  return pool.format.dtype;
}

// `pool` holds the cache type `expected` (that of `expected_name`).
inline void require_pool_dtype(const char* fn, const std::string& name, const PoolView& pool, DType expected,
                               const std::string& expected_name) {
  require_cache_dtype(fn, name, pool);
  if (pool.format.dtype != expected) {
    throw InvalidArgument(std::string(fn) + ": " + name + ".format.dtype = " + to_string(pool.format.dtype) +
                          ": expected " + to_string(expected) + " (" + expected_name +
                          ".format.dtype: the pools of one cache hold one type)");
  }
}

// The three pools' common cache type; InvalidArgument naming the first pool
// that differs from pools[FP16].
inline DType require_pool_dtypes(const char* fn, const PoolViews& pools) {
  const DType dtype = require_cache_dtype(fn, "pools[FP16]", pools[pool_index(Precision::FP16)]);
  for (Precision p : {Precision::INT4, Precision::INT2}) {
    require_pool_dtype(fn, "pools[" + std::string(to_string(p)) + "]", pools[pool_index(p)], dtype, "pools[FP16]");
  }
  return dtype;
}

// A 16-bit array `arg` (of type `dtype`, as the caller says) given to an op
// over a cache of type `cache`: InvalidArgument naming both unless equal.
inline void require_input_dtype(const char* fn, const char* arg, DType dtype, DType cache, const char* cache_name) {
  if (dtype != cache) {
    throw InvalidArgument(std::string(fn) + ": " + arg + " = " + to_string(dtype) + ": expected " + to_string(cache) +
                          " (" + cache_name + ".format.dtype, the cache's 16-bit type)");
  }
}

}  // namespace mixkv::gpu::detail
