#pragma once
// Host-side helpers of the GPU planner's entry points (internal).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "mixkv/core/errors.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::gpu::planner_detail {

constexpr std::size_t align16(std::size_t n) { return (n + 15) & ~std::size_t{15}; }
constexpr std::size_t align4(std::size_t n) { return (n + 3) & ~std::size_t{3}; }

// Lays out arrays in one allocation, each 16-byte aligned, so that a batch
// takes one upload and one buffer.
struct Carver {
  std::size_t total = 0;
  std::size_t add(std::size_t bytes) {
    const std::size_t offset = total;
    total = align16(total + bytes);
    return offset;
  }
};

template <typename T>
T* at_offset(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

inline std::size_t element_bytes(ElementType type) { return type == ElementType::F32 ? 4 : 2; }

// 16-byte loads need every row to start on a 16-byte boundary.
inline bool rows_aligned(std::span<const EmbeddingsView> views) {
  for (const EmbeddingsView& v : views) {
    if (reinterpret_cast<std::uintptr_t>(v.data) % 16 != 0) return false;
    if (static_cast<std::size_t>(v.hidden) * element_bytes(v.type) % 16 != 0) return false;
  }
  return true;
}

inline std::string indexed(const char* name, std::size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// The kernels are instantiated per element type: one type per launch.
inline void require_one_type(std::span<const EmbeddingsView> views, const char* name) {
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (views[i].type != views[0].type) {
      throw InvalidArgument(indexed(name, i) + ".type = " + std::to_string(static_cast<int>(views[i].type)) +
                            ", expected " + std::to_string(static_cast<int>(views[0].type)) + " as " + name +
                            "[0] (one element type per batch on the GPU)");
    }
  }
}

// Requests (or layers) of one launch go on gridDim.y.
constexpr std::size_t kMaxRequests = 65535;

}  // namespace mixkv::gpu::planner_detail
