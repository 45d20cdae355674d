// Eq. 9 on the device: the cosine between each layer's hidden states before
// and after its attention, batched over layers, in double (a calibration
// step: exactness over speed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "device_math.cuh"
#include "host_helpers.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "mixkv/planner/cuda_window_planner.h"

namespace mixkv::gpu {

using namespace planner_detail;

namespace {

struct SensitivityArgs {
  const unsigned long long* before;  // [layers] address of row 0
  const unsigned long long* after;   // [layers]
  double* sums;                      // [layers][tokens][3]: dot, |a|^2, |b|^2
  double* out;                       // [layers]
  int* status;                       // [flag, layer, token, side (0 before, 1 after)]
  long long tokens;
  int hidden;
  int token_mean;
};

__device__ void report_sensitivity(int* status, int layer, long long token, int side) {
  if (atomicCAS(status, 0, 1) == 0) {
    status[1] = layer;
    status[2] = static_cast<int>(token);
    status[3] = side;
  }
}

// Per (layer, token), a warp: dot, |a|^2, |b|^2 in double.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads) token_sums_kernel(SensitivityArgs a) {
  const long long t = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int layer = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  if (t >= a.tokens) return;
  const auto* x = reinterpret_cast<const T*>(a.before[layer]) + t * a.hidden;
  const auto* y = reinterpret_cast<const T*>(a.after[layer]) + t * a.hidden;
  double d = 0.0, nx = 0.0, ny = 0.0;
  for (int c = lane; c < a.hidden; c += kWarp) {
    const double xc = to_float(x[c]);
    const double yc = to_float(y[c]);
    d += xc * yc;
    nx += xc * xc;
    ny += yc * yc;
  }
  d = warp_sum(d);
  nx = warp_sum(nx);
  ny = warp_sum(ny);
  if (lane == 0) {
    if (!isfinite(nx)) report_sensitivity(a.status, layer, t, 0);
    if (!isfinite(ny)) report_sensitivity(a.status, layer, t, 1);
    double* s = a.sums + (static_cast<long long>(layer) * a.tokens + t) * 3;
    s[0] = d;
    s[1] = nx;
    s[2] = ny;
  }
}

// A block a layer; fixed-order tree sums, so results are reproducible.
__global__ void __launch_bounds__(kBlockThreads) layer_reduce_kernel(SensitivityArgs a) {
  __shared__ double partial[4][kBlockThreads];
  const int layer = blockIdx.x;
  double dot = 0.0, nx = 0.0, ny = 0.0, cosine = 0.0;
  for (long long t = threadIdx.x; t < a.tokens; t += blockDim.x) {
    const double* s = a.sums + (static_cast<long long>(layer) * a.tokens + t) * 3;
    dot += s[0];
    nx += s[1];
    ny += s[2];
    if (s[1] > 0.0 && s[2] > 0.0) cosine += s[0] / sqrt(s[1] * s[2]);
  }
  partial[0][threadIdx.x] = dot;
  partial[1][threadIdx.x] = nx;
  partial[2][threadIdx.x] = ny;
  partial[3][threadIdx.x] = cosine;
  __syncthreads();
  for (int stride = kBlockThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      for (int q = 0; q < 4; ++q) partial[q][threadIdx.x] += partial[q][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double s = 0.0;
    if (a.token_mean) {
      s = partial[3][0] / static_cast<double>(a.tokens);
    } else if (partial[1][0] > 0.0 && partial[2][0] > 0.0) {
      s = partial[0][0] / sqrt(partial[1][0] * partial[2][0]);
    }
    a.out[layer] = fmin(1.0, fmax(-1.0, s));
  }
}

}  // namespace

std::vector<double> layer_sensitivity(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                      SensitivityReduction reduction, cudaStream_t stream) {
  validate_sensitivity_inputs(before, after, reduction);
  require_one_type(before, "before");
  for (std::size_t l = 0; l < after.size(); ++l) {
    if (after[l].type != before[0].type) {
      throw InvalidArgument(indexed("after", l) + ".type = " + std::to_string(static_cast<int>(after[l].type)) +
                            ", expected " + std::to_string(static_cast<int>(before[0].type)) +
                            " as before[0] (one element type on the GPU)");
    }
  }
  const std::size_t layers = before.size();
  if (layers > kMaxRequests) {
    throw InvalidArgument("before holds " + std::to_string(layers) + " layers, expected at most " +
                          std::to_string(kMaxRequests) + " on the GPU");
  }
  const long long tokens = before[0].num_tokens;

  Carver carve;
  const std::size_t o_before = carve.add(layers * 8);
  const std::size_t o_after = carve.add(layers * 8);
  const std::size_t o_out = carve.add(layers * 8);
  const std::size_t o_status = carve.add(16);
  const std::size_t o_sums = carve.add(layers * static_cast<std::size_t>(tokens) * 3 * 8);
  // Freed when the call returns, after its stream was synchronized.
  detail::DeviceBuffer<std::byte> scratch;
  scratch.reserve(carve.total, stream);

  std::vector<unsigned long long> addresses(2 * layers);
  for (std::size_t l = 0; l < layers; ++l) {
    addresses[l] = reinterpret_cast<std::uintptr_t>(before[l].data);
    addresses[layers + l] = reinterpret_cast<std::uintptr_t>(after[l].data);
  }
  MIXKV_CUDA_CHECK(
      cudaMemcpyAsync(scratch.get() + o_before, addresses.data(), layers * 8, cudaMemcpyHostToDevice, stream));
  MIXKV_CUDA_CHECK(
      cudaMemcpyAsync(scratch.get() + o_after, addresses.data() + layers, layers * 8, cudaMemcpyHostToDevice, stream));
  MIXKV_CUDA_CHECK(cudaMemsetAsync(scratch.get() + o_status, 0, 16, stream));

  SensitivityArgs a{};
  a.before = at_offset<const unsigned long long>(scratch.get(), o_before);
  a.after = at_offset<const unsigned long long>(scratch.get(), o_after);
  a.sums = at_offset<double>(scratch.get(), o_sums);
  a.out = at_offset<double>(scratch.get(), o_out);
  a.status = at_offset<int>(scratch.get(), o_status);
  a.tokens = tokens;
  a.hidden = before[0].hidden;
  a.token_mean = reduction == SensitivityReduction::TokenMean ? 1 : 0;

  const dim3 grid(static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock), static_cast<unsigned>(layers));
  switch (before[0].type) {
    case ElementType::F32: token_sums_kernel<float><<<grid, kBlockThreads, 0, stream>>>(a); break;
    case ElementType::F16: token_sums_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(a); break;
    case ElementType::BF16: token_sums_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(a); break;
  }
  MIXKV_CUDA_CHECK_LAUNCH("token_sums_kernel");
  layer_reduce_kernel<<<static_cast<unsigned>(layers), kBlockThreads, 0, stream>>>(a);
  MIXKV_CUDA_CHECK_LAUNCH("layer_reduce_kernel");

  std::vector<double> sensitivities(layers);
  int status[4] = {0, 0, 0, 0};
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(sensitivities.data(), a.out, layers * 8, cudaMemcpyDeviceToHost, stream));
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(status, a.status, sizeof status, cudaMemcpyDeviceToHost, stream));
  MIXKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (status[0] != 0) {
    throw InvalidArgument(indexed(status[3] == 0 ? "before" : "after", static_cast<std::size_t>(status[1])) + " row " +
                          std::to_string(status[2]) +
                          " (hidden state) holds a NaN or infinite value, expected finite embeddings");
  }
  return sensitivities;
}

}  // namespace mixkv::gpu
