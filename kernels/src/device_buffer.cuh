#pragma once
// RAII owners of device memory, pinned host memory and events (internal).
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "cuda_check.cuh"

namespace mixkv::gpu::detail {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) { allocate(count); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}

  void allocate(std::size_t count) {
    release();
    if (count == 0) return;
    void* p = nullptr;
    MIXKV_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
    ptr_ = static_cast<T*>(p);
    count_ = count;
  }
  // Grows (contents are not kept) to hold at least `count` elements.
  void reserve(std::size_t count) {
    if (count > count_) allocate(count + count / 2);
  }
  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }

 private:
  void release() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void reserve(std::size_t count) {
    if (count <= count_) return;
    release();
    void* p = nullptr;
    const std::size_t n = count + count / 2;
    MIXKV_CUDA_CHECK(cudaMallocHost(&p, n * sizeof(T)));
    ptr_ = static_cast<T*>(p);
    count_ = n;
  }
  T* get() const { return ptr_; }

 private:
  void release() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

// An event that is only waited on after it was recorded.
class Event {
 public:
  Event() = default;
  ~Event() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream) {
    if (event_ == nullptr) MIXKV_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    MIXKV_CUDA_CHECK(cudaEventRecord(event_, stream));
    recorded_ = true;
  }
  void synchronize() const {
    if (recorded_) MIXKV_CUDA_CHECK(cudaEventSynchronize(event_));
  }

 private:
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

}  // namespace mixkv::gpu::detail
