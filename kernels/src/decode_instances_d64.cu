// Decode kernel instances for head_dim 64. Default build: block_size {32},
// one n-tile; MIXKV_ALL_KERNEL_INSTANCES adds block sizes 16 and 64 and the
// two-tile instances (up to 16 query heads an item).
#include <string>

#include "decode_dispatch.h"
#include "decode_launch.cuh"
#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {

#if defined(MIXKV_ALL_KERNEL_INSTANCES)
#define MIXKV_D64_ALL 1
#else
#define MIXKV_D64_ALL 0
#endif

bool decode_d64_supports(int block_size, int n_tiles) {
  const bool block = block_size == 32 || (MIXKV_D64_ALL && (block_size == 16 || block_size == 64));
  return block && (n_tiles == 1 || (MIXKV_D64_ALL && n_tiles == 2));
}

int launch_decode_d64(const DecodeParams& params, int block_size, int n_tiles, int grid, cudaStream_t stream) {
  if (n_tiles == 1 && block_size == 32) return launch_decode_kernel<64, 32, 1>(params, grid, stream);
#if MIXKV_D64_ALL
  if (n_tiles == 1) {
    switch (block_size) {
      case 16: return launch_decode_kernel<64, 16, 1>(params, grid, stream);
      case 64: return launch_decode_kernel<64, 64, 1>(params, grid, stream);
      default: break;
    }
  } else if (n_tiles == 2) {
    switch (block_size) {
      case 16: return launch_decode_kernel<64, 16, 2>(params, grid, stream);
      case 32: return launch_decode_kernel<64, 32, 2>(params, grid, stream);
      case 64: return launch_decode_kernel<64, 64, 2>(params, grid, stream);
      default: break;
    }
  }
#endif
  check_decode_supported(64, block_size);  // throws for an unbuilt block size
  throw InvalidArgument("Unsupported head tiles: " + std::to_string(n_tiles) + " at head_dim 64");
}

}  // namespace mixkv::gpu::detail
