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
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cpu/cpu_test_util.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"

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

// Fractions of full windows in FP16 / INT4 (the rest INT2).
struct Mix {
  double fp16, int4;
};
inline constexpr Mix kAllFp16{1.0, 0.0};
inline constexpr Mix kAllInt4{0.0, 1.0};
inline constexpr Mix kAllInt2{0.0, 0.0};

// Sequences of `contexts` tokens of random K/V of the cache's type T, each
// full window at a precision drawn by `mix`.
template <Float16Element T>
std::vector<BasicSequenceData<T>> mixed_sequences(const std::vector<int>& contexts, int heads, int dim, int block,
                                                  Mix mix, Rng& rng) {
  std::vector<BasicSequenceData<T>> seqs;
  for (int tokens : contexts) {
    BasicSequenceData<T> s;
    s.tokens = tokens;
    s.k = random_values<T>(rng, static_cast<std::size_t>(tokens) * heads * dim, 1.0);
    s.v = random_values<T>(rng, s.k.size(), 1.0);
    for (int w = 0; w < tokens / block; ++w) {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      s.windows.push_back(u < mix.fp16 ? Precision::FP16
                                       : (u < mix.fp16 + mix.int4 ? Precision::INT4 : Precision::INT2));
    }
    seqs.push_back(std::move(s));
  }
  return seqs;
}

// Blocks of each pool enough for `contexts` whatever their windows' mix.
inline std::array<std::int32_t, kNumPrecisions> blocks_needed(const std::vector<int>& contexts, int block) {
  std::int32_t total = 0;
  for (int t : contexts) total += t / block + 2;
  return {total, total, total};
}

// Page lists of `placed` into slots 0.. of `layer`.
inline void fill_tables(gpu::DevicePageTables& tables, const PlacedBatch& placed, int layer = 0) {
  const std::size_t batch = placed.tables[0].indptr.size() - 1;
  for (std::size_t b = 0; b < batch; ++b) {
    for (Precision p : kAllPrecisions) {
      const PagedPoolTable& t = placed.tables[pool_index(p)];
      const std::span<const std::int32_t> list(t.indices.data() + t.indptr[b], t.indptr[b + 1] - t.indptr[b]);
      tables.set_blocks(static_cast<std::int32_t>(b), layer, p, list, p == Precision::FP16 ? t.last_block_len[b] : 0);
    }
  }
}

// The longest page list of `placed` (at least 1): the tables' bound.
inline std::int32_t longest_list(const PlacedBatch& placed) {
  std::int32_t longest = 1;
  for (const auto& t : placed.tables) {
    for (std::size_t b = 0; b + 1 < t.indptr.size(); ++b) longest = std::max(longest, t.indptr[b + 1] - t.indptr[b]);
  }
  return longest;
}

}  // namespace mixkv::test
