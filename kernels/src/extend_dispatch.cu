#include <string>

#include "extend_dispatch.cuh"
#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {
namespace {

struct ExtendInstance {
  int head_dim;
  int block_size;
  int (*launch)(const ExtendParams& params, int grid, cudaStream_t stream);
};

// The built instances: extend_instances.inc is written by
// kernels/CMakeLists.txt from its instance list, one
// MIXKV_EXTEND_INSTANCE(D, S) a line.
constexpr ExtendInstance kInstances[] = {
#define MIXKV_EXTEND_INSTANCE(D, S) {D, S, &launch_extend_kernel<D, S>},
#include "extend_instances.inc"
#undef MIXKV_EXTEND_INSTANCE
};

const ExtendInstance* find_instance(int head_dim, int block_size) {
  for (const ExtendInstance& i : kInstances) {
    if (i.head_dim == head_dim && i.block_size == block_size) return &i;
  }
  return nullptr;
}

bool head_dim_built(int head_dim) {
  for (const ExtendInstance& i : kInstances) {
    if (i.head_dim == head_dim) return true;
  }
  return false;
}

}  // namespace

void check_extend_supported(int head_dim, int block_size) {
  if (!head_dim_built(head_dim)) throw InvalidArgument("Unsupported head_dim: " + std::to_string(head_dim));
  if (find_instance(head_dim, block_size) == nullptr) {
    throw InvalidArgument("Unsupported block_size: " + std::to_string(block_size));
  }
}

int launch_extend(const ExtendParams& params, int head_dim, int block_size, int grid, cudaStream_t stream) {
  if (const ExtendInstance* instance = find_instance(head_dim, block_size)) {
    return instance->launch(params, grid, stream);
  }
  check_extend_supported(head_dim, block_size);  // throws for every unbuilt shape
  throw InvalidArgument("Unsupported extend shape: head_dim " + std::to_string(head_dim) + ", block_size " +
                        std::to_string(block_size));
}

}  // namespace mixkv::gpu::detail
