#include "mixkv/core/cache_shape.h"

#include <string>

#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

// Every packed run and metadata array of a block stays 16-byte aligned only
// when these dimensions are multiples of 16 (block_format.h).
void require_multiple_of_16(const char* field, std::int32_t value, std::int32_t lo, std::int32_t hi) {
  if (value < lo || value > hi || value % 16 != 0) {
    throw InvalidArgument("shape." + std::string(field) + " = " + std::to_string(value) +
                          ", expected a multiple of 16 in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
}

}  // namespace

void validate(const CacheShape& shape) {
  if (shape.num_layers < 1) {
    throw InvalidArgument("shape.num_layers = " + std::to_string(shape.num_layers) + ", expected >= 1");
  }
  if (shape.num_kv_heads < 1) {
    throw InvalidArgument("shape.num_kv_heads = " + std::to_string(shape.num_kv_heads) + ", expected >= 1");
  }
  require_multiple_of_16("head_dim", shape.head_dim, 16, 512);
  require_multiple_of_16("block_size", shape.block_size, 16, 256);
  if (!is_cache_dtype(shape.dtype)) {
    throw InvalidArgument("shape.dtype = " + to_string(shape.dtype) + ", expected float16 or bfloat16");
  }
}

std::string to_string(const CacheShape& s) {
  return "CacheShape(num_layers=" + std::to_string(s.num_layers) + ", num_kv_heads=" + std::to_string(s.num_kv_heads) +
         ", head_dim=" + std::to_string(s.head_dim) + ", block_size=" + std::to_string(s.block_size) +
         (s.dtype == DType::F16 ? std::string() : ", dtype=" + to_string(s.dtype)) + ")";
}

}  // namespace mixkv
