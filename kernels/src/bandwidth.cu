#include "mixkv/kernels/bandwidth.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

// Four independent 16-byte loads in flight per thread per iteration.
// Streaming loads (kCached false) measure HBM without polluting L2; cached
// ones fill L2 with the buffer, which is how the flusher evicts.
template <bool kCached>
__global__ void read_reduce_kernel(const uint4* data, std::size_t chunks, unsigned* sink) {
  unsigned acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < chunks; i += 4 * stride) {
    uint4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = kCached ? __ldcg(data + i + u * stride) : __ldcs(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
  }
  for (; i < chunks; i += stride) {
    const uint4 x = kCached ? __ldcg(data + i) : __ldcs(data + i);
    acc ^= x.x ^ x.y ^ x.z ^ x.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads alive; practically never stores
}

__global__ void fill_kernel(uint4* data, std::size_t chunks) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const unsigned h = static_cast<unsigned>(i) * 2654435761u;
    data[i] = make_uint4(h, h ^ 0x5bd1e995u, h + 1u, h * 7u);
  }
}

void launch_read_reduce(const uint4* data, std::size_t chunks, unsigned* sink, cudaStream_t stream) {
  int device = 0, sms = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  read_reduce_kernel<false><<<sms * 8, 512, 0, stream>>>(data, chunks, sink);
  MIXKV_CUDA_CHECK_LAUNCH("read_reduce_kernel");
}

}  // namespace

void launch_streaming_read(const void* data, std::size_t bytes, unsigned* sink, cudaStream_t stream) {
  detail::require(data != nullptr && reinterpret_cast<std::uintptr_t>(data) % 16 == 0,
                  "launch_streaming_read: data: expected a 16-byte aligned device pointer");
  detail::require(bytes > 0 && bytes % 16 == 0, [&] {
    return "launch_streaming_read: bytes = " + std::to_string(bytes) + ": expected a positive multiple of 16";
  });
  detail::require(sink != nullptr, "launch_streaming_read: sink: expected a device pointer to one unsigned");
  launch_read_reduce(static_cast<const uint4*>(data), bytes / 16, sink, stream);
}

double measure_read_bandwidth(std::size_t bytes, int repetitions, cudaStream_t stream) {
  detail::require(bytes >= (1u << 20), "measure_read_bandwidth: bytes: expected >= 1 MiB");
  detail::require(repetitions >= 1, "measure_read_bandwidth: repetitions: expected >= 1");
  const std::size_t chunks = bytes / 16;
  detail::DeviceBuffer<uint4> data(chunks);
  detail::DeviceBuffer<unsigned> sink(1);
  int device = 0, sms = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  fill_kernel<<<sms * 8, 256, 0, stream>>>(data.get(), chunks);
  MIXKV_CUDA_CHECK_LAUNCH("fill_kernel");
  cudaEvent_t start, stop;
  MIXKV_CUDA_CHECK(cudaEventCreate(&start));
  MIXKV_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int rep = -2; rep < repetitions; ++rep) {
    MIXKV_CUDA_CHECK(cudaEventRecord(start, stream));
    launch_read_reduce(data.get(), chunks, sink.get(), stream);
    MIXKV_CUDA_CHECK(cudaEventRecord(stop, stream));
    MIXKV_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0.0f;
    MIXKV_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    if (rep >= 0) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return static_cast<double>(chunks * 16) / (ms[ms.size() / 2] * 1e-3);
}

L2Flusher::L2Flusher(FlushMode mode) : mode_(mode) {
  int device = 0, l2 = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  bytes_ = std::max<std::size_t>(static_cast<std::size_t>(l2) * 4, 64u << 20);
  // A constructor that throws runs no destructor: free what was allocated.
  try {
    MIXKV_CUDA_CHECK(cudaMalloc(&buffer_, bytes_));
    MIXKV_CUDA_CHECK(cudaMalloc(&sink_, sizeof(unsigned)));
    // Touched once, so that the first read flush does not hit fresh pages.
    MIXKV_CUDA_CHECK(cudaMemset(buffer_, 0, bytes_));
  } catch (...) {
    release();
    throw;
  }
}

L2Flusher::~L2Flusher() { release(); }

void L2Flusher::release() {
  if (buffer_ != nullptr) cudaFree(buffer_);
  if (sink_ != nullptr) cudaFree(sink_);
  buffer_ = nullptr;
  sink_ = nullptr;
}

void L2Flusher::flush(cudaStream_t stream) {
  if (mode_ == FlushMode::write) {
    MIXKV_CUDA_CHECK(cudaMemsetAsync(buffer_, 0, bytes_, stream));
    return;
  }
  int device = 0, sms = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  read_reduce_kernel<true><<<sms * 8, 512, 0, stream>>>(static_cast<const uint4*>(buffer_), bytes_ / 16, sink_);
  MIXKV_CUDA_CHECK_LAUNCH("read_reduce_kernel (L2 flush)");
}

}  // namespace mixkv::gpu
