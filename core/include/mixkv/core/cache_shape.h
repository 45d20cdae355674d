#pragma once
#include <cstdint>

namespace mixkv {

// The geometry every pool of one cache shares. block_size is also the
// WindowQuant window: one quantized block holds exactly one window.
struct CacheShape {
  std::int32_t num_layers = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t block_size = 32;

  friend bool operator==(const CacheShape&, const CacheShape&) = default;
};

// Throws InvalidArgument naming the field unless: num_layers >= 1,
// num_kv_heads >= 1, head_dim a multiple of 16 in [16, 512], block_size a
// multiple of 16 in [16, 256] (so every packed run and metadata array of a
// block stays 16-byte aligned).
void validate(const CacheShape& shape);

}  // namespace mixkv
