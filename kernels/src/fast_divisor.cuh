#pragma once
// Division of non-negative 31-bit integers by a divisor fixed on the host.
#include <cuda_runtime.h>

#include <cstdint>

namespace mixkv::gpu::detail {

// n / d for 0 <= n < 2^31 by a multiply-high, an add and a shift, with the
// multiplier computed on the host (Granlund and Montgomery 1994, fig. 4.1:
// l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(n, m)
// + n) >> l; n < 2^31 keeps the sum in 32 bits). A division by a runtime
// divisor takes ~20 instructions where this takes 3: the store kernel's
// tile loop divides by num_kv_heads, and every block address divides a
// block id by the pool's blocks_per_slab (DevicePool).
class FastDivisor {
 public:
  FastDivisor() = default;
  __host__ explicit FastDivisor(std::uint32_t d) : divisor_(d) {
    while ((std::uint64_t{1} << shift_) < d) ++shift_;
    multiplier_ = static_cast<std::uint32_t>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << shift_) - d)) / d + 1);
  }
  __device__ int div(int n) const {
    return static_cast<int>((__umulhi(static_cast<std::uint32_t>(n), multiplier_) + n) >> shift_);
  }
  __device__ int mod(int n) const { return n - div(n) * static_cast<int>(divisor_); }

 private:
  std::uint32_t divisor_ = 1, multiplier_ = 1, shift_ = 0;
};

}  // namespace mixkv::gpu::detail
