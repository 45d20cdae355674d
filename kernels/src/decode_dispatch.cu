#include "decode_dispatch.h"

#include <string>

#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {
namespace {

struct DecodeInstance {
  int head_dim;
  int block_size;
  int n_tiles;
  int (*launch)(const DecodeParams& params, int grid, cudaStream_t stream);
};

// The built instances: decode_instances.inc is written by kernels/CMakeLists.txt
// from its instance list, one MIXKV_DECODE_INSTANCE(D, S, NT) a line.
constexpr DecodeInstance kInstances[] = {
#define MIXKV_DECODE_INSTANCE(D, S, NT) {D, S, NT, &launch_decode_kernel<D, S, NT>},
#include "decode_instances.inc"
#undef MIXKV_DECODE_INSTANCE
};

const DecodeInstance* find_instance(int head_dim, int block_size, int n_tiles) {
  for (const DecodeInstance& i : kInstances) {
    if (i.head_dim == head_dim && i.block_size == block_size && i.n_tiles == n_tiles) return &i;
  }
  return nullptr;
}

bool head_dim_built(int head_dim) {
  for (const DecodeInstance& i : kInstances) {
    if (i.head_dim == head_dim) return true;
  }
  return false;
}

}  // namespace

void check_decode_supported(int head_dim, int block_size) {
  if (!head_dim_built(head_dim)) throw InvalidArgument("Unsupported head_dim: " + std::to_string(head_dim));
  if (find_instance(head_dim, block_size, 1) == nullptr) {
    throw InvalidArgument("Unsupported block_size: " + std::to_string(block_size));
  }
}

bool decode_supports_two_tiles(int head_dim, int block_size) {
  return find_instance(head_dim, block_size, 2) != nullptr;
}

int launch_decode(const DecodeParams& params, int head_dim, int block_size, int n_tiles, int grid,
                  cudaStream_t stream) {
  if (const DecodeInstance* instance = find_instance(head_dim, block_size, n_tiles)) {
    return instance->launch(params, grid, stream);
  }
  check_decode_supported(head_dim, block_size);  // throws for an unbuilt head_dim or block size
  throw InvalidArgument("Unsupported head tiles: " + std::to_string(n_tiles) + " at head_dim " +
                        std::to_string(head_dim));
}

}  // namespace mixkv::gpu::detail
