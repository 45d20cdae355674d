// Fault injection on the device (docs/reliability.md): the arena's one
// cudaMalloc failing. It must surface as OutOfMemory naming the call, leave
// nothing allocated, and leave the CUDA runtime usable: a cudaMalloc failure
// also sets the runtime's last-error state, which a later launch check
// (cudaGetLastError after a launch) would otherwise report as that launch's
// failure. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "../cuda/cuda_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/device_arena.h"

namespace mixkv {
namespace {

using test::DeviceArenaCopy;
using test::DeviceVector;
using test::TestArena;

std::size_t device_free_bytes() {
  std::size_t free = 0, total = 0;
  test::cuda_ok(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

TEST(DeviceArenaFault, CudaMallocFailureIsOutOfMemoryAndLeavesTheRuntimeUsable) {
  MIXKV_REQUIRE_CUDA();
  const std::size_t free_before = device_free_bytes();
  // 4 PiB: more than any device holds.
  try {
    gpu::DeviceArena arena(std::size_t{1} << 52);
    FAIL() << "a 4 PiB arena was allocated";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMalloc"), std::string::npos) << e.what();
  }
  EXPECT_EQ(device_free_bytes(), free_before) << "the failed allocation left memory allocated";

  // The next arena and the next launch work: one FP16 block demoted to INT4
  // on the device equals the CPU's requantization, byte for byte.
  TestArena host(2, 64, 16, {1, 1, 0});
  const std::int32_t src = host.alloc(Precision::FP16);
  const std::int32_t dst = host.alloc(Precision::INT4);
  const BlockFormat f16 = host.format(Precision::FP16);
  const std::size_t values = std::size_t{16} * 64;
  for (int h = 0; h < 2; ++h) {
    const auto k = test::random_halves(host.rng(), values, 3.0);
    const auto v = test::random_halves(host.rng(), values, 0.7);
    cpu::write_head(f16, k.data(), v.data(), 64, host.view(Precision::FP16).block(src) + f16.head_offset(h));
  }
  DeviceArenaCopy device(host);
  const std::vector<BlockCopy> moves = {{src, dst}};
  DeviceVector<BlockCopy> dmoves(moves);
  ASSERT_NO_THROW(gpu::demote(
      {dmoves.get(), 1, device.pools[pool_index(Precision::FP16)], device.pools[pool_index(Precision::INT4)], nullptr}))
      << "the first launch after a failed cudaMalloc reported that failure as its own";
  const std::vector<DemoteOp> ops = {{0, 0, 1, Precision::FP16, src, Precision::INT4, dst}};
  cpu::demote(ops, host.views());
  EXPECT_EQ(device.download(), host.bytes());
}

TEST(DeviceArenaFault, RepeatedFailuresLeakNothing) {
  MIXKV_REQUIRE_CUDA();
  const std::size_t free_before = device_free_bytes();
  for (int i = 0; i < 100; ++i) EXPECT_THROW(gpu::DeviceArena(std::size_t{1} << 52), OutOfMemory);
  // cudaMemGetInfo counts whole pages; no failed attempt may hold any.
  EXPECT_EQ(device_free_bytes(), free_before);
  gpu::DeviceArena ok(std::size_t{1} << 20);
  EXPECT_NE(ok.base(), nullptr);
}

}  // namespace
}  // namespace mixkv
