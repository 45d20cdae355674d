#pragma once
#include <cstdint>
#include <span>

namespace mixkv::cpu {

// Merge attention states of the same queries over disjoint key sets:
//   lse = log(exp(lse_a) + exp(lse_b)),
//   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
// LSE is the natural log. An empty state has lse = -inf and contributes
// nothing; two empty states merge to an empty state (out 0, lse -inf), never
// NaN. Shapes: out_* [num_states][head_dim], lse_* [num_states]; out_a /
// lse_a may alias out / lse (in-place accumulation).
void merge_states(std::span<const float> out_a, std::span<const float> lse_a, std::span<const float> out_b,
                  std::span<const float> lse_b, std::int32_t head_dim, std::span<float> out, std::span<float> lse);

}  // namespace mixkv::cpu
