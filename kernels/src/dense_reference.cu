#include "mixkv/kernels/dense_reference.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <string>

#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw DeviceError(std::string(what) + " failed: cuBLAS status " + std::to_string(static_cast<int>(status)));
  }
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (sizeof(T) == 2) {
    return __half2float(x);
  } else {
    return x;
  }
}
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (sizeof(T) == 2) {
    return __float2half_rn(x);
  } else {
    return x;
  }
}

__device__ float block_reduce(float x, bool is_max, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : (is_max ? -INFINITY : 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, offset);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (lane == 0) scratch[32] = x;
  }
  __syncthreads();
  const float r = scratch[32];
  __syncthreads();
  return r;
}

// In-place softmax of one row of `tokens` scores times `scale`.
template <typename T>
__global__ void softmax_rows_kernel(T* scores, int tokens, float scale) {
  __shared__ float scratch[33];
  T* row = scores + static_cast<std::size_t>(blockIdx.x) * tokens;
  float mx = -INFINITY;
  for (int t = threadIdx.x; t < tokens; t += blockDim.x) mx = fmaxf(mx, to_float(row[t]) * scale);
  mx = block_reduce(mx, true, scratch);
  float sum = 0.0f;
  for (int t = threadIdx.x; t < tokens; t += blockDim.x) sum += __expf(to_float(row[t]) * scale - mx);
  sum = block_reduce(sum, false, scratch);
  const float inv = 1.0f / sum;
  for (int t = threadIdx.x; t < tokens; t += blockDim.x)
    row[t] = from_float<T>(__expf(to_float(row[t]) * scale - mx) * inv);
}

void check_shape(const DenseAttentionShape& s) {
  detail::require(s.batch >= 1 && s.num_kv_heads >= 1 && s.tokens >= 1 && s.head_dim >= 1,
                  "DenseAttention: batch, num_kv_heads, tokens, head_dim: expected >= 1");
  detail::require(s.num_q_heads >= 1 && s.num_q_heads % s.num_kv_heads == 0, [&] {
    return "DenseAttention: num_q_heads = " + std::to_string(s.num_q_heads) +
           ": expected a positive multiple of num_kv_heads";
  });
  detail::require(s.sm_scale > 0.0f, "DenseAttention: sm_scale: expected > 0");
}

}  // namespace

struct DenseAttention::Impl {
  cublasHandle_t handle = nullptr;
  detail::DeviceBuffer<char> scores;
};

DenseAttention::DenseAttention() : impl_(std::make_unique<Impl>()) {
  check_cublas(cublasCreate(&impl_->handle), "cublasCreate");
}

DenseAttention::~DenseAttention() {
  if (impl_->handle != nullptr) cublasDestroy(impl_->handle);
}

template <typename T>
static void run_dense(cublasHandle_t handle, detail::DeviceBuffer<char>& workspace, const DenseAttentionShape& s,
                      const T* q, const T* k, const T* v, T* out, cudaStream_t stream) {
  check_shape(s);
  constexpr bool kHalf = sizeof(T) == 2;
  const cudaDataType_t type = kHalf ? CUDA_R_16F : CUDA_R_32F;
  const int group = s.num_q_heads / s.num_kv_heads;
  const int batches = s.batch * s.num_kv_heads;
  const long long T_ = s.tokens, D = s.head_dim;
  workspace.reserve(static_cast<std::size_t>(batches) * group * T_ * sizeof(T));
  T* scores = reinterpret_cast<T*>(workspace.get());
  check_cublas(cublasSetStream(handle, stream), "cublasSetStream");
  const float one = 1.0f, zero = 0.0f;
  // scores (T x group, column-major) = K^T Q  per (sequence, KV head)
  check_cublas(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.tokens, group, s.head_dim, &one, k, type,
                                          s.head_dim, T_ * D, q, type, s.head_dim, group * D, &zero, scores, type,
                                          s.tokens, T_ * group, batches, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx (scores)");
  softmax_rows_kernel<T><<<batches * group, 256, 0, stream>>>(scores, s.tokens, s.sm_scale);
  MIXKV_CUDA_CHECK_LAUNCH("softmax_rows_kernel");
  // out (D x group, column-major = [group][D]) = V^T P
  check_cublas(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, s.head_dim, group, s.tokens, &one, v, type,
                                          s.head_dim, T_ * D, scores, type, s.tokens, T_ * group, &zero, out, type,
                                          s.head_dim, group * D, batches, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx (output)");
}

void DenseAttention::run_fp32(const DenseAttentionShape& shape, const float* q, const float* k, const float* v,
                              float* out, cudaStream_t stream) {
  run_dense<float>(impl_->handle, impl_->scores, shape, q, k, v, out, stream);
}

void DenseAttention::run_fp16(const DenseAttentionShape& shape, const Half* q, const Half* k, const Half* v, Half* out,
                              cudaStream_t stream) {
  run_dense<__half>(impl_->handle, impl_->scores, shape, reinterpret_cast<const __half*>(q),
                    reinterpret_cast<const __half*>(k), reinterpret_cast<const __half*>(v),
                    reinterpret_cast<__half*>(out), stream);
}

}  // namespace mixkv::gpu
