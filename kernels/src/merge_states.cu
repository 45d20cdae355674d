#include "mixkv/kernels/merge_states.h"

#include <string>

#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::gpu {
namespace {

// One CTA per state. Empty states are handled by branches, as in the CPU
// reference, so -inf - -inf never occurs.
__global__ void merge_states_kernel(MergeStatesArgs a) {
  const int state = blockIdx.x;
  const float la = a.lse_a[state];
  const float lb = a.lse_b[state];
  const std::size_t base = static_cast<std::size_t>(state) * a.head_dim;
  float wa, wb, lse;
  if (la == -INFINITY && lb == -INFINITY) {
    wa = 0.0f;
    wb = 0.0f;
    lse = -INFINITY;
  } else if (lb == -INFINITY) {
    wa = 1.0f;
    wb = 0.0f;
    lse = la;
  } else if (la == -INFINITY) {
    wa = 0.0f;
    wb = 1.0f;
    lse = lb;
  } else {
    const float m = fmaxf(la, lb);
    const float ea = expf(la - m);
    const float eb = expf(lb - m);
    const float sum = ea + eb;
    wa = ea / sum;
    wb = eb / sum;
    lse = m + logf(sum);
  }
  // Weights of 0 multiply nothing: an empty side's output is never read.
  for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
    float o = 0.0f;
    if (wa != 0.0f) o += wa * a.out_a[base + c];
    if (wb != 0.0f) o += wb * a.out_b[base + c];
    a.out[base + c] = o;
  }
  // Everyone has read lse_a / lse_b before thread 0 may overwrite an alias.
  __syncthreads();
  if (threadIdx.x == 0) a.lse[state] = lse;
}

}  // namespace

void merge_states(const MergeStatesArgs& a) {
  detail::require(a.num_states >= 0,
                  [&] { return "merge_states: num_states = " + std::to_string(a.num_states) + ": expected >= 0"; });
  detail::require(a.head_dim >= 1,
                  [&] { return "merge_states: head_dim = " + std::to_string(a.head_dim) + ": expected >= 1"; });
  if (a.num_states == 0) return;
  detail::require(a.out_a && a.lse_a && a.out_b && a.lse_b && a.out && a.lse,
                  "merge_states: out_a, lse_a, out_b, lse_b, out, lse: expected device pointers, got a null one");
  merge_states_kernel<<<a.num_states, 128, 0, a.stream>>>(a);
  MIXKV_CUDA_CHECK_LAUNCH("merge_states_kernel");
}

}  // namespace mixkv::gpu
