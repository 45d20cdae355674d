// The merge of split extend tiles: each piece of a tile wrote its rows'
// normalized output and base-2 LSE into the partial workspace; one CTA a
// tile merges them by log-sum-exp into the output (of the cache's 16-bit
// type E) and the natural-log LSE. Pieces with an empty state (LSE -inf: a piece of new-row units a
// row does not see) weigh 0; a row always sees itself, so the merged sum
// is positive.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "elem16.cuh"
#include "extend_dispatch.cuh"
#include "mixkv/kernels/detail/cuda_check.h"

namespace mixkv::gpu::detail {
namespace {

inline constexpr int kMergeThreads = 256;

template <typename E>
__global__ void __launch_bounds__(kMergeThreads) extend_merge_kernel(const __grid_constant__ ExtendMergeParams p) {
  const int2 range = p.task_range != nullptr ? *p.task_range : p.launch_range;
  if (static_cast<int>(blockIdx.x) >= range.y) return;
  const ExtendMergeTask task = p.tasks[range.x + blockIdx.x];
  const int group = p.group;
  const int rows = min(kExtendTileRows, task.n_new * group - task.row0);
  const int vecs_per_row = p.head_dim / 4;
  constexpr float kLn2 = 0.6931471805599453f;
  for (int v = threadIdx.x; v < rows * vecs_per_row; v += kMergeThreads) {
    const int local = v / vecs_per_row;
    const int c4 = v - local * vecs_per_row;
    float mx = -INFINITY;
    for (int k = 0; k < task.pieces; ++k) {
      mx = fmaxf(mx, __ldcg(p.partial_lse + static_cast<std::size_t>(task.first + k) * kExtendTileRows + local));
    }
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float sum = 0.0f;
    if (mx != -INFINITY) {
      for (int k = 0; k < task.pieces; ++k) {
        const std::size_t row = static_cast<std::size_t>(task.first + k) * kExtendTileRows + local;
        const float w = exp2f(__ldcg(p.partial_lse + row) - mx);
        const float4 x = __ldcg(reinterpret_cast<const float4*>(p.partial_out + row * p.head_dim) + c4);
        sum += w;
        o.x += w * x.x;
        o.y += w * x.y;
        o.z += w * x.z;
        o.w += w * x.w;
      }
    }
    const float inv = sum > 0.0f ? __frcp_rn(sum) : 0.0f;
    const int m = task.row0 + local;
    const int j = m / group;
    const std::size_t out_row =
        static_cast<std::size_t>(task.q_begin + j) * p.num_q_heads + task.kv_head * group + (m - j * group);
    auto* dst = reinterpret_cast<typename Elem16<E>::T2*>(static_cast<E*>(p.out) + out_row * p.head_dim + 4 * c4);
    dst[0] = Elem16<E>::round2(o.x * inv, o.y * inv);
    dst[1] = Elem16<E>::round2(o.z * inv, o.w * inv);
    if (c4 == 0 && p.lse != nullptr) p.lse[out_row] = sum > 0.0f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
  }
}

}  // namespace

void launch_extend_merge(const ExtendMergeParams& params, DType dtype, int grid, cudaStream_t stream) {
  if (dtype == DType::BF16) {
    extend_merge_kernel<__nv_bfloat16><<<grid, kMergeThreads, 0, stream>>>(params);
  } else {
    extend_merge_kernel<__half><<<grid, kMergeThreads, 0, stream>>>(params);
  }
  MIXKV_CUDA_CHECK_LAUNCH("extend_merge_kernel");
}

}  // namespace mixkv::gpu::detail
