#pragma once
// THE dispatch point of the extend kernels: runtime (16-bit type, head_dim,
// block_size) -> template instance. The built instances are the lists in
// kernels/CMakeLists.txt (FP16 and BF16), one generated
// extend_instance_*.cu an entry; extend_dispatch.cu looks a shape up in
// them. Unbuilt shapes throw InvalidArgument "Unsupported head_dim: N" /
// "Unsupported block_size: N" (naming the type for BF16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "extend_params.cuh"
#include "mixkv/core/dtype.h"

namespace mixkv::gpu::detail {

// Throws for a shape with no built instance of `dtype`; launches nothing.
void check_extend_supported(DType dtype, int head_dim, int block_size);
// Whether `dtype` has an instance at the shape.
bool extend_built(DType dtype, int head_dim, int block_size);
// grid == 0: configures the instance (its shared-memory opt-in) and returns
// its CTAs per SM; otherwise launches `grid` CTAs and returns 0.
int launch_extend(const ExtendParams& params, DType dtype, int head_dim, int block_size, int grid, cudaStream_t stream);
// The merge of split tiles (extend_merge.cu): one CTA a task, writing
// `dtype` (the cache's type).
void launch_extend_merge(const ExtendMergeParams& params, DType dtype, int grid, cudaStream_t stream);

// One instance's launcher (extend_launch.cuh), explicitly instantiated only
// in its generated file, so that the dispatch compiles no kernel.
template <typename E, int D, int S>
int launch_extend_kernel(const ExtendParams& params, int grid, cudaStream_t stream);

}  // namespace mixkv::gpu::detail
