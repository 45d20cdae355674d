#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "mixkv/core/dtype.h"

namespace mixkv {

// Where an array's bytes live.
enum class DeviceKind : std::uint8_t { CPU = 0, CUDA = 1 };

// A C-contiguous array owned by the caller, as the engine's entry points take
// it (the Python bindings fill it from DLPack or the array interfaces without
// copying). Up to 4 dimensions; shape[i] for i >= ndim is 1.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F16;
  DeviceKind device = DeviceKind::CPU;
  std::int32_t device_id = 0;  // the CUDA device ordinal (0 on the CPU)
  std::int32_t ndim = 0;
  std::array<std::int64_t, 4> shape{1, 1, 1, 1};

  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_bytes(dtype); }
};

// Checks `t` against what a call expects and throws InvalidArgument naming
// `fn` and `name`: "Engine::attend: q: expected dtype float16 on cuda:0 with
// shape (8, 32, 128), got float32 on cpu with shape (8, 32, 128)". A -1 in
// `shape` accepts any extent there. Also refused: ndim outside [0, 4], a
// negative extent, and a null data pointer for a non-empty array.
// `device_id` is compared for CUDA arrays only.
void require_tensor(const char* fn, const char* name, const TensorView& t, DType dtype, DeviceKind device,
                    std::int32_t device_id, std::initializer_list<std::int64_t> shape);

}  // namespace mixkv
