#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace mixkv::gpu {

// Merge attention states of the same queries over disjoint key sets, the
// rule of cpu::merge_states: natural-log LSE,
//   lse = log(exp(lse_a) + exp(lse_b)),
//   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse);
// an empty state (lse = -inf) contributes nothing and two empty states merge
// to (0, -inf), never NaN. out_* [num_states][head_dim], lse_* [num_states],
// float, device memory; out/lse may alias out_a/lse_a.
struct MergeStatesArgs {
  const float* out_a = nullptr;
  const float* lse_a = nullptr;
  const float* out_b = nullptr;
  const float* lse_b = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  std::int32_t num_states = 0;
  std::int32_t head_dim = 0;
  cudaStream_t stream = nullptr;
};
void merge_states(const MergeStatesArgs& args);

}  // namespace mixkv::gpu
