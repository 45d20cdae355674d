#pragma once
// Helpers of the CUDA backend tests. They reuse the CPU tests' hand-made
// arena and placement (tests/cpu/cpu_test_util.h): data is placed and
// checked by the CPU reference, copied to the device, and the kernels'
// results are compared with the reference's.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cpu/cpu_test_util.h"
#include "mixkv/kernels/device_arena.h"

// Every GPU test starts with this: on a machine without a CUDA device the
// test is reported as skipped, visibly, instead of passing silently.
#define MIXKV_REQUIRE_CUDA()                                                      \
  do {                                                                            \
    if (!::mixkv::gpu::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace mixkv::test {

inline void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// A device allocation holding a copy of a host vector (or `count` elements).
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(std::size_t count) : count_(count) {
    cuda_ok(cudaMalloc(&ptr_, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) {
    if (!host.empty()) cuda_ok(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D");
  }
  ~DeviceVector() { cudaFree(ptr_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return static_cast<T*>(ptr_); }
  std::vector<T> to_host() const {
    std::vector<T> host(count_);
    cuda_ok(cudaDeviceSynchronize(), "sync");
    if (count_ > 0) cuda_ok(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
    return host;
  }
  void fill_bytes(int value) { cuda_ok(cudaMemset(ptr_, value, count_ * sizeof(T)), "memset"); }

 private:
  void* ptr_ = nullptr;
  std::size_t count_ = 0;
};

// The views of a TestArena with num_blocks set as the manager sets it
// (every slab of the arena times the pool's blocks a slab): ids below it
// address bytes inside the arena, whichever pool owns the slab.
inline PoolViews bounded_views(TestArena& host) {
  PoolViews views = host.views();
  for (PoolView& v : views) {
    v.num_blocks = static_cast<std::int32_t>(host.bytes().size() / v.slab_bytes) * v.blocks_per_slab;
  }
  return views;
}

// The same as a PoolLayout (no base), what DeviceStoreMapping::upload and
// DevicePageTables take from the manager.
inline PoolLayout layout_of(TestArena& host) {
  PoolLayout layout;
  layout.bytes = host.bytes().size();
  layout.pools = bounded_views(host);
  for (PoolView& v : layout.pools) v.base = nullptr;
  return layout;
}

// The device twin of a TestArena: same bytes, same slab arithmetic.
struct DeviceArenaCopy {
  gpu::DeviceArena arena;
  gpu::DevicePools pools;
  explicit DeviceArenaCopy(TestArena& host) : arena(host.bytes().size()) {
    upload(host);
    pools = bounded_views(host);
    for (PoolView& v : pools) v.base = arena.base();
  }
  void upload(TestArena& host) {
    cuda_ok(cudaMemcpy(arena.base(), host.bytes().data(), host.bytes().size(), cudaMemcpyHostToDevice), "H2D arena");
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> bytes(arena.bytes());
    cuda_ok(cudaDeviceSynchronize(), "sync");
    cuda_ok(cudaMemcpy(bytes.data(), arena.base(), bytes.size(), cudaMemcpyDeviceToHost), "D2H arena");
    return bytes;
  }
};

// Output error normalized per (sequence, query head) row by the row's
// largest reference magnitude: FP16 output rounding alone is <= 2.5e-4.
struct ErrorStats {
  double mean = 0.0;
  double max = 0.0;
  bool finite = true;
};
inline ErrorStats row_errors(const std::vector<float>& out, const std::vector<float>& ref, int dim) {
  ErrorStats s;
  const std::size_t rows = ref.size() / dim;
  double sum = 0.0;
  for (std::size_t r = 0; r < rows; ++r) {
    double scale = 1e-6;
    for (int c = 0; c < dim; ++c) scale = std::max(scale, std::abs(static_cast<double>(ref[r * dim + c])));
    for (int c = 0; c < dim; ++c) {
      const double o = out[r * dim + c];
      if (!std::isfinite(o)) s.finite = false;
      const double e = std::abs(o - ref[r * dim + c]) / scale;
      sum += e;
      s.max = std::max(s.max, e);
    }
  }
  s.mean = ref.empty() ? 0.0 : sum / static_cast<double>(ref.size());
  return s;
}

inline std::vector<float> halves_to_floats(const std::vector<Half>& h) { return widen(h); }

// The context survived: no sticky error, and the device still synchronizes.
inline void expect_context_usable(const char* after) {
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "after " << after;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "after " << after;
}

// Runs `call`, which must throw E with a message holding every one of `parts`.
template <class E, class Call>
void expect_error_naming(Call&& call, std::initializer_list<std::string> parts) {
  try {
    call();
    ADD_FAILURE() << "did not throw; expected a message naming " << *parts.begin();
  } catch (const E& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message does not name '" << part << "': " << e.what();
    }
  }
}

}  // namespace mixkv::test
