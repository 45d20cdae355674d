#pragma once
// Argument checks shared by the cache's translation units (private header).
#include <cstdint>
#include <string>
#include <string_view>

#include "mixkv/core/errors.h"
#include "mixkv/core/precision.h"

namespace mixkv::detail {

// A Precision cast from an arbitrary integer (e.g. through the bindings).
inline void require_precision(Precision p, std::string_view name) {
  const int index = pool_index(p);
  if (index < 0 || index >= kNumPrecisions) {
    throw InvalidArgument(std::string(name) + " = " + std::to_string(index) +
                          ", expected FP16 (0), INT4 (1) or INT2 (2)");
  }
}

inline void require_index(std::string_view name, std::int64_t value, std::int64_t size) {
  if (value < 0 || value >= size) {
    throw IndexOutOfRange(std::string(name) + " = " + std::to_string(value) + ", expected 0 <= " + std::string(name) +
                          " < " + std::to_string(size));
  }
}

}  // namespace mixkv::detail
