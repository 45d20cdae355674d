// Decode kernel instances for head_dim 64. Default build: block_size {32};
// MIXKV_ALL_KERNEL_INSTANCES adds the rest of {16, 32, 64}.
#include "decode_dispatch.h"
#include "decode_launch.cuh"

namespace mixkv::gpu::detail {

#if defined(MIXKV_ALL_KERNEL_INSTANCES)
#define MIXKV_D64_SMALL_AND_LARGE_BLOCKS 1
#else
#define MIXKV_D64_SMALL_AND_LARGE_BLOCKS 0
#endif

bool decode_d64_supports(int block_size) {
  return block_size == 32 || (MIXKV_D64_SMALL_AND_LARGE_BLOCKS && (block_size == 16 || block_size == 64));
}

int launch_decode_d64(const DecodeParams& params, int block_size, int grid, cudaStream_t stream) {
  switch (block_size) {
    case 32: return launch_decode_kernel<64, 32>(params, grid, stream);
#if MIXKV_D64_SMALL_AND_LARGE_BLOCKS
    case 16: return launch_decode_kernel<64, 16>(params, grid, stream);
    case 64: return launch_decode_kernel<64, 64>(params, grid, stream);
#endif
    default: check_decode_supported(64, block_size);  // throws
  }
  return 0;
}

}  // namespace mixkv::gpu::detail
