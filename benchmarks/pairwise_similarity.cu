#include "pairwise_similarity.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::bench {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw DeviceError(std::string(what) + " failed: cuBLAS status " + std::to_string(static_cast<int>(status)));
}

std::size_t element_bytes(ElementType type) { return type == ElementType::F32 ? 4 : 2; }

std::size_t align16(std::size_t n) { return (n + 15) & ~std::size_t{15}; }

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// Row `i` of `dst` = normalized row `rows[i]` (an address), in float, a warp
// a row with the norm in double; a zero row stays zero. No NaN check: this is
// the reference path.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    normalize_rows_kernel(const unsigned long long* rows, int count, int hidden, float* dst) {
  const int i = blockIdx.x * kWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= count) return;
  const auto* row = reinterpret_cast<const T*>(rows[i]);
  double squares = 0.0;
  for (int c = lane; c < hidden; c += kWarp) {
    const double x = widen(row[c]);
    squares += x * x;
  }
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  const double inverse = squares > 0.0 ? 1.0 / sqrt(squares) : 0.0;
  for (int c = lane; c < hidden; c += kWarp) {
    dst[static_cast<long long>(i) * hidden + c] = static_cast<float>(widen(row[c]) * inverse);
  }
}

// scores[i] = mean of the cosines of window i's S columns against all N text
// rows; cosines is column-major [window rows, N] (cuBLAS's C). Fixed-order
// tree sum, so results are reproducible.
__global__ void __launch_bounds__(kThreads)
    window_mean_kernel(const float* cosines, int window_rows, int text_rows, int window_size, float* scores) {
  __shared__ double partial[kThreads];
  const int window = blockIdx.x;
  double sum = 0.0;
  const long long cells = static_cast<long long>(text_rows) * window_size;
  for (long long e = threadIdx.x; e < cells; e += blockDim.x) {
    const long long n = e / window_size;
    const long long k = e % window_size;
    sum += cosines[n * window_rows + static_cast<long long>(window) * window_size + k];
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) scores[window] = static_cast<float>(partial[0] / static_cast<double>(cells));
}

void launch_normalize(ElementType type, const unsigned long long* rows, int count, int hidden, float* dst,
                      cudaStream_t stream) {
  if (count == 0) return;
  const int blocks = (count + kWarps - 1) / kWarps;
  switch (type) {
    case ElementType::F32:
      normalize_rows_kernel<float><<<blocks, kThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
    case ElementType::F16:
      normalize_rows_kernel<__half><<<blocks, kThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
    case ElementType::BF16:
      normalize_rows_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
  }
  MIXKV_CUDA_CHECK_LAUNCH("normalize_rows_kernel");
}

}  // namespace

PairwiseSimilarity::PairwiseSimilarity() { check_cublas(cublasCreate(&cublas_), "cublasCreate"); }

PairwiseSimilarity::~PairwiseSimilarity() {
  if (cublas_ != nullptr) cublasDestroy(cublas_);
}

void PairwiseSimilarity::run(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                             std::int32_t window_size, float* scores, cudaStream_t stream) {
  validate_similarity_inputs(layouts, embeddings, window_size);
  if (layouts.empty()) return;
  if (scores == nullptr) throw InvalidArgument("scores is null, expected one device float per window");
  const std::int32_t hidden = embeddings[0].hidden;

  // Row addresses per request: text rows, then each window's rows.
  std::vector<std::vector<unsigned long long>> rows(layouts.size());
  std::vector<std::int32_t> text_count(layouts.size()), window_count(layouts.size());
  std::size_t most_rows = 0, most_text = 0, most_window_rows = 0;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    const auto base = reinterpret_cast<std::uintptr_t>(embeddings[r].data);
    const std::size_t row_bytes = static_cast<std::size_t>(hidden) * element_bytes(embeddings[r].type);
    std::int32_t position = 0;
    for (const Segment& s : layouts[r].segments()) {
      if (s.kind == TokenKind::Text) {
        for (std::int32_t t = position; t < position + s.length; ++t) rows[r].push_back(base + t * row_bytes);
      }
      position += s.length;
    }
    text_count[r] = static_cast<std::int32_t>(rows[r].size());
    const std::vector<std::int32_t> starts = layouts[r].window_starts(window_size);
    window_count[r] = static_cast<std::int32_t>(starts.size());
    for (const std::int32_t start : starts) {
      for (std::int32_t k = 0; k < window_size; ++k) rows[r].push_back(base + (start + k) * row_bytes);
    }
    most_rows = std::max(most_rows, rows[r].size());
    most_text = std::max<std::size_t>(most_text, text_count[r]);
    most_window_rows = std::max(most_window_rows, rows[r].size() - text_count[r]);
  }

  // One scratch allocation: row addresses, normalized rows, cosines.
  const std::size_t o_normalized = align16(most_rows * 8);
  const std::size_t o_cosines = o_normalized + align16(most_rows * static_cast<std::size_t>(hidden) * 4);
  scratch_.reserve(o_cosines + most_text * most_window_rows * 4, stream);
  auto* d_rows = reinterpret_cast<unsigned long long*>(scratch_.get());
  auto* normalized = reinterpret_cast<float*>(scratch_.get() + o_normalized);
  auto* cosines = reinterpret_cast<float*>(scratch_.get() + o_cosines);

  check_cublas(cublasSetStream(cublas_, stream), "cublasSetStream");
  std::size_t first_score = 0;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    const int n = text_count[r];
    const int m = window_count[r] * window_size;
    if (m > 0) {
      // Pageable source: the call returns once the rows are staged, so the
      // vector may go; the copy itself stays in stream order.
      MIXKV_CUDA_CHECK(cudaMemcpyAsync(d_rows, rows[r].data(), rows[r].size() * 8, cudaMemcpyHostToDevice, stream));
      launch_normalize(embeddings[r].type, d_rows, static_cast<int>(rows[r].size()), hidden, normalized, stream);
      // Column-major view: the normalized rows are [hidden x rows]; C[m x n] =
      // window_rows^T (m x hidden) * text_rows (hidden x n).
      const float one = 1.0f, zero = 0.0f;
      const float* text = normalized;
      const float* window = normalized + static_cast<std::size_t>(n) * hidden;
      check_cublas(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, hidden, &one, window, CUDA_R_32F, hidden, text,
                                CUDA_R_32F, hidden, &zero, cosines, CUDA_R_32F, m, CUBLAS_COMPUTE_32F_PEDANTIC,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
      window_mean_kernel<<<window_count[r], kThreads, 0, stream>>>(cosines, m, n, window_size, scores + first_score);
      MIXKV_CUDA_CHECK_LAUNCH("window_mean_kernel");
    }
    first_score += static_cast<std::size_t>(window_count[r]);
  }
}

}  // namespace mixkv::bench
