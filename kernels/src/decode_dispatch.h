#pragma once
// THE dispatch point of the decode kernels: runtime (16-bit type, head_dim,
// block_size, n-tiles) -> template instance. The built instances are the
// list in kernels/CMakeLists.txt (the same shapes for FP16 and BF16), one
// generated decode_instance_*.cu a (type, shape); decode_dispatch.cu looks
// a shape up in that list. Unbuilt shapes throw InvalidArgument
// "Unsupported head_dim: N" / "Unsupported block_size: N" (naming the type
// for BF16).
#include <cuda_runtime_api.h>

#include "decode_params.cuh"
#include "mixkv/core/dtype.h"

namespace mixkv::gpu::detail {

// Host-side copies of the kernel's limits: query heads of one MMA n-tile;
// an instance computes items of one or two n-tiles (up to 8 or 16 heads).
inline constexpr int kHeadsPerTileHost = 8;
// Most decode CTAs one SM can hold (sizes the default item capacity).
inline constexpr int kMaxCtasPerSm = 4;
// Split-KV chunks of one (sequence, KV head) at most (the in-kernel merge
// then runs two levels of <= 32 rows, decode_merge.cuh).
inline constexpr int kMaxMergePieces = 1024;

// Throws for a shape with no built one-tile instance of `dtype`; launches
// nothing.
void check_decode_supported(DType dtype, int head_dim, int block_size);
// Whether the shape's instance of `dtype` with `n_tiles` is built.
bool decode_built(DType dtype, int head_dim, int block_size, int n_tiles);
// grid == 0: configures the instance and returns its CTAs per SM.
int launch_decode(const DecodeParams& params, DType dtype, int head_dim, int block_size, int n_tiles, int grid,
                  cudaStream_t stream);

// One instance's launcher (decode_launch.cuh), explicitly instantiated only
// in its generated file, so that the dispatch compiles no kernel.
template <typename E, int D, int S, int NT>
int launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream);

}  // namespace mixkv::gpu::detail
