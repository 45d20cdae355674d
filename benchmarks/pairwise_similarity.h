#pragma once
// Eq. 8 the paper's way, on the GPU: the all-pairs reference that
// gpu_planner_bench times against CudaWindowPlanner and that the planner's
// GPU test checks against the double loop.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "mixkv/core/token_layout.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::bench {

// Every text token against every window token, as one cuBLAS GEMM per request
// of the normalized text rows [N, D] by the normalized window rows
// [W S, D]^T, in FP32 (pedantic: no TF32, whatever the handle's math mode,
// so that it stays a reference), followed by the mean over each window's
// N x S block. O(N M D) work where CudaWindowPlanner does O((N + M) D).
class PairwiseSimilarity {
 public:
  // Creates a cuBLAS handle on the current device; throws DeviceError.
  PairwiseSimilarity();
  ~PairwiseSimilarity();
  PairwiseSimilarity(const PairwiseSimilarity&) = delete;
  PairwiseSimilarity& operator=(const PairwiseSimilarity&) = delete;

  // Writes each request's window scores, in batch order, to `scores` (device
  // memory, one float per window), in the order of `stream`: the scratch
  // grows on it and is reused by the next call, so give one object one
  // stream. Validation as window_similarity(); an empty batch does nothing.
  void run(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings, std::int32_t window_size,
           float* scores, cudaStream_t stream);

 private:
  cublasHandle_t cublas_ = nullptr;
  gpu::detail::DeviceBuffer<std::byte> scratch_;
};

}  // namespace mixkv::bench
