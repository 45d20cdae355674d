#pragma once
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "mixkv/core/half.h"

namespace mixkv::gpu {

// Dense decode attention through cuBLAS, for references and baselines:
// S = Q K^T (strided-batched GEMM per (sequence, KV head), the query-head
// group as rows), a row softmax, O = P V. Every sequence has `tokens` keys.
// Layouts (device): q [batch][num_q_heads][head_dim],
// k, v [batch][num_kv_heads][tokens][head_dim], out [batch][num_q_heads][head_dim].
struct DenseAttentionShape {
  std::int32_t batch = 0;
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t tokens = 0;
  std::int32_t head_dim = 0;
  float sm_scale = 0.0f;
};

class DenseAttention {
 public:
  DenseAttention();
  ~DenseAttention();
  DenseAttention(const DenseAttention&) = delete;
  DenseAttention& operator=(const DenseAttention&) = delete;

  // FP32 everywhere (the tests' reference for shapes too large for the CPU).
  void run_fp32(const DenseAttentionShape& shape, const float* q, const float* k, const float* v, float* out,
                cudaStream_t stream);
  // FP16 storage, FP32 accumulation (the benchmark's dense FP16 baseline).
  void run_fp16(const DenseAttentionShape& shape, const Half* q, const Half* k, const Half* v, Half* out,
                cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv::gpu
