#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mixkv {

// IEEE binary16 storage on the host, bit-compatible with CUDA's __half and
// NumPy's float16. Host code converts through these functions so that the CPU
// backend needs no CUDA headers; device code reinterprets the same bits.
struct Half {
  std::uint16_t bits = 0;
  friend bool operator==(Half a, Half b) = default;
};
static_assert(sizeof(Half) == 2);

// Round-to-nearest-even, as __float2half_rn does, so host and device agree bit
// for bit on every stored scale, minimum and FP16 value.
inline Half float_to_half(float value) {
  std::uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN (keep NaN quiet and non-zero)
    return {static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs >= 0x477ff000u) {  // rounds to a magnitude >= 65520: overflow to inf
    return {static_cast<std::uint16_t>(sign | 0x7c00u)};
  }
  if (abs < 0x38800000u) {                                             // result is subnormal (or zero) in binary16
    if (abs < 0x33000000u) return {static_cast<std::uint16_t>(sign)};  // < 2^-25: zero
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24 for this range
    std::uint32_t result = mantissa >> shift;
    const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return {static_cast<std::uint16_t>(sign | result)};
  }
  std::uint32_t result = ((abs - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const std::uint32_t remainder = abs & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return {static_cast<std::uint16_t>(sign | result)};
}

inline float half_to_float(Half h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  std::uint32_t exponent = (h.bits >> 10) & 0x1fu;
  std::uint32_t mantissa = h.bits & 0x3ffu;
  std::uint32_t x;
  if (exponent == 0x1fu) {
    x = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    x = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    x = sign;
  } else {  // subnormal: normalize
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    x = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &x, sizeof value);
  return value;
}

// half_to_float over `count` packed halves at `halves` (any alignment): the
// same exact values, with F16C conversions when the CPU has them (the CPU
// backend reads every FP16 block row through this). Throws InvalidArgument
// naming the pointer if either is null while count > 0.
void halves_to_floats(const std::byte* halves, float* out, std::size_t count);

}  // namespace mixkv
