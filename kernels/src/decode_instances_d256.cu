// Decode kernel instances for head_dim 256. Default build: block_size {32};
// MIXKV_ALL_KERNEL_INSTANCES adds 16 and 64. One n-tile only: two would
// double its 64 accumulators a thread, and one already fills the registers.
#include <string>

#include "decode_dispatch.h"
#include "decode_launch.cuh"
#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {

#if defined(MIXKV_ALL_KERNEL_INSTANCES)
#define MIXKV_D256_SMALL_AND_LARGE_BLOCKS 1
#else
#define MIXKV_D256_SMALL_AND_LARGE_BLOCKS 0
#endif

bool decode_d256_supports(int block_size, int n_tiles) {
  return n_tiles == 1 &&
         (block_size == 32 || (MIXKV_D256_SMALL_AND_LARGE_BLOCKS && (block_size == 16 || block_size == 64)));
}

int launch_decode_d256(const DecodeParams& params, int block_size, int n_tiles, int grid, cudaStream_t stream) {
  if (n_tiles == 1) {
    switch (block_size) {
      case 32: return launch_decode_kernel<256, 32, 1>(params, grid, stream);
#if MIXKV_D256_SMALL_AND_LARGE_BLOCKS
      case 16: return launch_decode_kernel<256, 16, 1>(params, grid, stream);
      case 64: return launch_decode_kernel<256, 64, 1>(params, grid, stream);
#endif
      default: break;
    }
  }
  check_decode_supported(256, block_size);  // throws for an unbuilt block size
  throw InvalidArgument("Unsupported head tiles: " + std::to_string(n_tiles) + " at head_dim 256");
}

}  // namespace mixkv::gpu::detail
