#pragma once
#include <array>
#include <cstdint>
#include <string_view>

#include "mixkv/core/host_device.h"

namespace mixkv {

// The storage precision of a block. The numeric values index per-pool arrays.
enum class Precision : std::uint8_t { FP16 = 0, INT4 = 1, INT2 = 2 };

inline constexpr int kNumPrecisions = 3;
inline constexpr std::array<Precision, kNumPrecisions> kAllPrecisions = {Precision::FP16, Precision::INT4,
                                                                         Precision::INT2};

MIXKV_HOST_DEVICE constexpr int pool_index(Precision p) { return static_cast<int>(p); }

MIXKV_HOST_DEVICE constexpr int bits_of(Precision p) {
  return p == Precision::FP16 ? 16 : (p == Precision::INT4 ? 4 : 2);
}

MIXKV_HOST_DEVICE constexpr bool is_quantized(Precision p) { return p != Precision::FP16; }

// Largest quantized code: 2^bits - 1.
MIXKV_HOST_DEVICE constexpr int max_code(Precision p) { return (1 << bits_of(p)) - 1; }

constexpr std::string_view to_string(Precision p) {
  switch (p) {
    case Precision::FP16: return "FP16";
    case Precision::INT4: return "INT4";
    case Precision::INT2: return "INT2";
  }
  return "?";
}

}  // namespace mixkv
