// Decode kernel instances for head_dim 128. Default build: block_size
// {16, 32, 64} with one n-tile (the tests sweep block sizes here) and 32
// with two (items of up to 16 query heads); MIXKV_ALL_KERNEL_INSTANCES adds
// two tiles at 16 and 64.
#include <string>

#include "decode_dispatch.h"
#include "decode_launch.cuh"
#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {

#if defined(MIXKV_ALL_KERNEL_INSTANCES)
#define MIXKV_D128_ALL 1
#else
#define MIXKV_D128_ALL 0
#endif

bool decode_d128_supports(int block_size, int n_tiles) {
  const bool block = block_size == 16 || block_size == 32 || block_size == 64;
  return block && (n_tiles == 1 || (n_tiles == 2 && (block_size == 32 || MIXKV_D128_ALL)));
}

int launch_decode_d128(const DecodeParams& params, int block_size, int n_tiles, int grid, cudaStream_t stream) {
  if (n_tiles == 1) {
    switch (block_size) {
      case 16: return launch_decode_kernel<128, 16, 1>(params, grid, stream);
      case 32: return launch_decode_kernel<128, 32, 1>(params, grid, stream);
      case 64: return launch_decode_kernel<128, 64, 1>(params, grid, stream);
      default: break;
    }
  } else if (n_tiles == 2) {
    switch (block_size) {
      case 32: return launch_decode_kernel<128, 32, 2>(params, grid, stream);
#if MIXKV_D128_ALL
      case 16: return launch_decode_kernel<128, 16, 2>(params, grid, stream);
      case 64: return launch_decode_kernel<128, 64, 2>(params, grid, stream);
#endif
      default: break;
    }
  }
  check_decode_supported(128, block_size);  // throws for an unbuilt block size
  throw InvalidArgument("Unsupported head tiles: " + std::to_string(n_tiles) + " at head_dim 128");
}

}  // namespace mixkv::gpu::detail
