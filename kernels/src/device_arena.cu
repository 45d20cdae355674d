#include "mixkv/kernels/device_arena.h"

#include <string>
#include <utility>

#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::gpu {

bool cuda_device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return false;
  }
  return count > 0;
}

DeviceArena::DeviceArena(std::size_t bytes) {
  detail::require(bytes > 0, "DeviceArena: bytes = 0: expected the arena size (> 0)");
  void* p = nullptr;
  MIXKV_CUDA_CHECK(cudaMalloc(&p, bytes));
  base_ = static_cast<std::byte*>(p);
  bytes_ = bytes;
}

DeviceArena::~DeviceArena() {
  if (base_ != nullptr) cudaFree(base_);
}

DeviceArena::DeviceArena(DeviceArena&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceArena& DeviceArena::operator=(DeviceArena&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) cudaFree(base_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DevicePools DeviceArena::pool_views(const PoolLayout& layout) const {
  detail::require(base_ != nullptr, "DeviceArena::pool_views: the arena was moved from: expected a live DeviceArena");
  detail::require(layout.bytes <= bytes_, [&] {
    return "DeviceArena::pool_views: layout.bytes = " + std::to_string(layout.bytes) + ": expected <= the arena's " +
           std::to_string(bytes_) + " bytes";
  });
  return layout.at(base_);
}

}  // namespace mixkv::gpu
