#pragma once
// THE dispatch point of the extend kernels: runtime (head_dim, block_size)
// -> template instance. The built instances are the list in
// kernels/CMakeLists.txt, one generated extend_instance_d*_s*.cu an entry;
// extend_dispatch.cu looks a shape up in that list. Unbuilt shapes throw
// InvalidArgument "Unsupported head_dim: N" / "Unsupported block_size: N".
#include <cuda_runtime_api.h>

#include "extend_params.cuh"

namespace mixkv::gpu::detail {

// Throws for a shape with no built instance; launches nothing.
void check_extend_supported(int head_dim, int block_size);
// grid == 0: configures the instance (its shared-memory opt-in) and returns
// its CTAs per SM; otherwise launches `grid` CTAs and returns 0.
int launch_extend(const ExtendParams& params, int head_dim, int block_size, int grid, cudaStream_t stream);
// The merge of split tiles (extend_merge.cu): one CTA a task.
void launch_extend_merge(const ExtendMergeParams& params, int grid, cudaStream_t stream);

// One instance's launcher (extend_launch.cuh), explicitly instantiated only
// in its generated file, so that the dispatch compiles no kernel.
template <int D, int S>
int launch_extend_kernel(const ExtendParams& params, int grid, cudaStream_t stream);

}  // namespace mixkv::gpu::detail
