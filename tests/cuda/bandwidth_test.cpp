// The benchmarks' read-and-reduce: a launch of any size completes, and bad
// arguments are rejected on the host before any CUDA call.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda_test_util.h"
#include "mixkv/kernels/bandwidth.h"

namespace mixkv::test {
namespace {

TEST(StreamingReadBadInput, NamesTheArgument) {
  // Never dereferenced: each call fails validation first.
  auto* aligned = reinterpret_cast<const void*>(std::uintptr_t{4096});
  auto* misaligned = reinterpret_cast<const void*>(std::uintptr_t{4104});
  auto* sink = reinterpret_cast<unsigned*>(std::uintptr_t{8192});
  MIXKV_EXPECT_INVALID(gpu::launch_streaming_read(nullptr, 16, sink, nullptr), "launch_streaming_read: data");
  MIXKV_EXPECT_INVALID(gpu::launch_streaming_read(misaligned, 16, sink, nullptr), "launch_streaming_read: data");
  MIXKV_EXPECT_INVALID(gpu::launch_streaming_read(aligned, 0, sink, nullptr), "launch_streaming_read: bytes = 0");
  MIXKV_EXPECT_INVALID(gpu::launch_streaming_read(aligned, 24, sink, nullptr), "launch_streaming_read: bytes = 24");
  MIXKV_EXPECT_INVALID(gpu::launch_streaming_read(aligned, 16, nullptr, nullptr), "launch_streaming_read: sink");
  MIXKV_EXPECT_INVALID(gpu::measure_read_bandwidth(1024, 1, nullptr), "measure_read_bandwidth: bytes");
}

// Sizes below, at and past one grid stride of 16-byte loads (the kernel's
// main loop takes four strides a round, a remainder loop the rest).
TEST(StreamingReadCuda, CompletesAtEverySize) {
  MIXKV_REQUIRE_CUDA();
  const std::size_t max_bytes = std::size_t{48} << 20;
  DeviceVector<unsigned char> data(std::vector<unsigned char>(max_bytes, 0x5a));
  DeviceVector<unsigned> sink(std::vector<unsigned>(1, 0u));
  for (std::size_t bytes : {std::size_t{16}, std::size_t{16} * 1000 + 16, std::size_t{1} << 20, max_bytes - 16}) {
    gpu::launch_streaming_read(data.get(), bytes, sink.get(), nullptr);
    cuda_ok(cudaDeviceSynchronize(), "streaming read");
  }
  EXPECT_GT(gpu::measure_read_bandwidth(std::size_t{8} << 20, 2, nullptr), 0.0);
}

}  // namespace
}  // namespace mixkv::test
