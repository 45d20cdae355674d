#pragma once
// THE dispatch point of the decode kernels: runtime (head_dim, block_size)
// -> template instance. Unbuilt shapes throw InvalidArgument
// "Unsupported head_dim: N" / "Unsupported block_size: N".
#include <cuda_runtime_api.h>

#include "decode_params.cuh"

namespace mixkv::gpu::detail {

// Host-side copies of the kernel's limits.
inline constexpr int kMaxGroupHost = 8;
// Split-KV aims at about this many work items per SM (3 CTAs fit per SM at
// head_dim 128: one full wave).
inline constexpr int kTargetItemsPerSm = 3;
// Split-KV chunks of one (sequence, KV head) at most (the merge keeps their
// weights in shared memory).
inline constexpr int kMaxMergePieces = 1024;

// Throws for a shape with no built instance; launches nothing.
void check_decode_supported(int head_dim, int block_size);
void launch_decode(const DecodeParams& params, int head_dim, int block_size, int grid, cudaStream_t stream);

// Per head_dim (decode_instances_d*.cu): switch on block_size.
bool decode_d64_supports(int block_size);
bool decode_d128_supports(int block_size);
bool decode_d256_supports(int block_size);
void launch_decode_d64(const DecodeParams& params, int block_size, int grid, cudaStream_t stream);
void launch_decode_d128(const DecodeParams& params, int block_size, int grid, cudaStream_t stream);
void launch_decode_d256(const DecodeParams& params, int block_size, int grid, cudaStream_t stream);

}  // namespace mixkv::gpu::detail
