// Decode kernel instances for head_dim 128. Default build: block_size {16, 32, 64};
// (MIXKV_ALL_KERNEL_INSTANCES changes nothing here.)
#include "decode_dispatch.h"
#include "decode_launch.cuh"

namespace mixkv::gpu::detail {

// The tests sweep block sizes at head_dim 128, so all three are built by default.
#define MIXKV_D128_SMALL_AND_LARGE_BLOCKS 1

bool decode_d128_supports(int block_size) {
  return block_size == 32 || (MIXKV_D128_SMALL_AND_LARGE_BLOCKS && (block_size == 16 || block_size == 64));
}

int launch_decode_d128(const DecodeParams& params, int block_size, int grid, cudaStream_t stream) {
  switch (block_size) {
    case 32: return launch_decode_kernel<128, 32>(params, grid, stream);
#if MIXKV_D128_SMALL_AND_LARGE_BLOCKS
    case 16: return launch_decode_kernel<128, 16>(params, grid, stream);
    case 64: return launch_decode_kernel<128, 64>(params, grid, stream);
#endif
    default: check_decode_supported(128, block_size);  // throws
  }
  return 0;
}

}  // namespace mixkv::gpu::detail
