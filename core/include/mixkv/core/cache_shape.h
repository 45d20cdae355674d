#pragma once
#include <cstdint>
#include <string>

#include "mixkv/core/dtype.h"

namespace mixkv {

// The geometry every pool of one cache shares, and its 16-bit float type.
// block_size is also the WindowQuant window: one quantized block holds
// exactly one window. dtype (F16 or BF16) is the type of every 16-bit value
// the cache stores: the FP16 pool's elements and the INT4/INT2 pools'
// (scale, min) parameters, so a block's bytes are the same size either way
// (BlockFormat::dtype); K, V, q and the outputs of the ops and the engine
// are in this type too.
struct CacheShape {
  std::int32_t num_layers = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t block_size = 32;
  DType dtype = DType::F16;

  friend bool operator==(const CacheShape&, const CacheShape&) = default;
};

// Throws InvalidArgument naming the field unless: num_layers >= 1,
// num_kv_heads >= 1, head_dim a multiple of 16 in [16, 512], block_size a
// multiple of 16 in [16, 256] (so every packed run and metadata array of a
// block stays 16-byte aligned), dtype F16 or BF16.
void validate(const CacheShape& shape);

// "CacheShape(num_layers=2, num_kv_heads=4, head_dim=128, block_size=32)",
// with ", dtype=bfloat16" before the parenthesis when dtype is not F16.
std::string to_string(const CacheShape& shape);

}  // namespace mixkv
