// The quantizer's hand-written float sequences (kernels/src/quantize.cuh)
// against the IEEE operations of the CPU reference, exhaustively: the
// reciprocal of every positive finite FP16 scale (rcp.approx plus one FMA,
// which no host code can emulate) and the quotient by 3 and by 15 of every
// FP16 range (hi - lo of two FP16 values lies in a wider set, so the
// quotient is also checked over every float of [0, 2^17) with a stride).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quantize.cuh"

namespace {

using mixkv::gpu::detail::range_over_max_code;
using mixkv::gpu::detail::reciprocal_of_half;

bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

__global__ void reciprocal_kernel(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = reciprocal_of_half(x[i]);
}

template <uint32_t kMaxCode>
__global__ void quotient_kernel(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = range_over_max_code<kMaxCode>(x[i]);
}

std::uint32_t bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Runs `kernel` over `inputs` on the device; returns the outputs.
template <typename Kernel>
std::vector<float> run(Kernel kernel, const std::vector<float>& inputs) {
  const int n = static_cast<int>(inputs.size());
  float *d_in = nullptr, *d_out = nullptr;
  EXPECT_EQ(cudaMalloc(&d_in, n * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_out, n * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_in, inputs.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  kernel<<<(n + 255) / 256, 256>>>(d_in, d_out, n);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), d_out, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_in);
  cudaFree(d_out);
  return out;
}

TEST(QuantizeMathCuda, ReciprocalOfEveryPositiveHalfIsTheIeeeReciprocal) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> x;
  for (std::uint32_t h = 1; h < 0x7c00u; ++h) {  // every positive finite FP16 value, subnormals included
    x.push_back(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
  const std::vector<float> got = run(reciprocal_kernel, x);
  int mismatches = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = 1.0f / x[i];
    if (bits(got[i]) != bits(want) && ++mismatches <= 5) {
      ADD_FAILURE() << "1 / " << x[i] << ": device " << got[i] << ", IEEE " << want;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << x.size() << " FP16 values";
}

template <uint32_t kMaxCode>
void expect_quotients(const std::vector<float>& ranges) {
  const std::vector<float> got = run(quotient_kernel<kMaxCode>, ranges);
  int mismatches = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const float want = ranges[i] / static_cast<float>(kMaxCode);
    if (bits(got[i]) != bits(want) && ++mismatches <= 5) {
      ADD_FAILURE() << ranges[i] << " / " << kMaxCode << ": device " << got[i] << ", IEEE " << want;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << ranges.size() << " ranges";
}

TEST(QuantizeMathCuda, QuotientByTheMaxCodeIsTheIeeeQuotient) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> ranges = {0.0f};
  for (std::uint32_t b = 1; b < 0x48000000u; b += 61) {  // floats in (0, 2^17): FP16 differences are below 2^17
    float f;
    std::memcpy(&f, &b, sizeof f);
    ranges.push_back(f);
  }
  expect_quotients<15>(ranges);
  expect_quotients<3>(ranges);
}

}  // namespace
