#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mixkv {

// bfloat16 storage on the host (the top 16 bits of an IEEE binary32),
// bit-compatible with CUDA's __nv_bfloat16 and torch.bfloat16. Host code
// converts through these functions so that the CPU backend needs no CUDA
// headers; device code reinterprets the same bits.
struct BFloat16 {
  std::uint16_t bits = 0;
  friend bool operator==(BFloat16 a, BFloat16 b) = default;
};
static_assert(sizeof(BFloat16) == 2);

// Round-to-nearest-even, as __float2bfloat16_rn does (and torch's
// conversion), so host and device agree bit for bit on every stored value,
// scale and minimum. NaN stays a quiet NaN of the same sign; a magnitude
// that rounds past the largest finite bfloat16 (~3.39e38) becomes inf.
inline BFloat16 float_to_bfloat16(float value) {
  std::uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((x >> 16) | 0x40u)};
  x += 0x7fffu + ((x >> 16) & 1u);
  return {static_cast<std::uint16_t>(x >> 16)};
}

inline float bfloat16_to_float(BFloat16 b) {
  const std::uint32_t x = static_cast<std::uint32_t>(b.bits) << 16;
  float value;
  std::memcpy(&value, &x, sizeof value);
  return value;
}

}  // namespace mixkv
