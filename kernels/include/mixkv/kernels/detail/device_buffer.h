#pragma once
// RAII owners of device memory, pinned host memory and events, shared by the
// CUDA backend and the GPU planner (a detail header: not part of the API).
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "mixkv/kernels/detail/cuda_check.h"

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
  // The same in the order of `stream` (cudaFreeAsync, cudaMallocAsync): work
  // queued on it before may still read the old memory, and the host does not
  // wait. The destructor's cudaFree takes such memory too, after waiting for
  // the device, so a buffer may outlive the stream it grew on.
  void reserve(std::size_t count, cudaStream_t stream) {
    if (count <= count_) return;
    if (ptr_ != nullptr) MIXKV_CUDA_CHECK(cudaFreeAsync(ptr_, stream));
    ptr_ = nullptr;
    count_ = 0;
    const std::size_t n = count + count / 2;
    void* p = nullptr;
    MIXKV_CUDA_CHECK(cudaMallocAsync(&p, n * sizeof(T), stream));
    ptr_ = static_cast<T*>(p);
    count_ = n;
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

// Pinned host memory, so that copies from and to it are truly asynchronous;
// with cudaHostAllocMapped kernels also read and write it directly through
// device(). Grow it only while no copy or kernel uses it.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(unsigned flags) : flags_(flags) {}
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // Grows (contents are not kept) to hold at least `count` elements.
  void reserve(std::size_t count) {
    if (count <= count_) return;
    release();
    void* p = nullptr;
    const std::size_t n = count + count / 2;
    MIXKV_CUDA_CHECK(cudaHostAlloc(&p, n * sizeof(T), flags_));
    ptr_ = static_cast<T*>(p);
    count_ = n;
    if ((flags_ & cudaHostAllocMapped) != 0) {
      void* d = nullptr;
      MIXKV_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
      device_ = static_cast<T*>(d);
    }
  }
  T* get() const { return ptr_; }
  // The device's address of a cudaHostAllocMapped buffer (null otherwise).
  T* device() const { return device_; }

 private:
  void release() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    device_ = nullptr;
    count_ = 0;
  }
  unsigned flags_ = cudaHostAllocDefault;
  T* ptr_ = nullptr;
  T* device_ = nullptr;
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
