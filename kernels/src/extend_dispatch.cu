#include <string>

#include "extend_dispatch.cuh"
#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {
namespace {

struct ExtendInstance {
  DType dtype;
  int head_dim;
  int block_size;
  int (*launch)(const ExtendParams& params, int grid, cudaStream_t stream);
};

// The built instances: extend_instances.inc is written by
// kernels/CMakeLists.txt from its instance lists, one
// MIXKV_EXTEND_INSTANCE(dtype, type, D, S) a line.
constexpr ExtendInstance kInstances[] = {
#define MIXKV_EXTEND_INSTANCE(T, E, D, S) {DType::T, D, S, &launch_extend_kernel<E, D, S>},
#include "extend_instances.inc"
#undef MIXKV_EXTEND_INSTANCE
};

const ExtendInstance* find_instance(DType dtype, int head_dim, int block_size) {
  for (const ExtendInstance& i : kInstances) {
    if (i.dtype == dtype && i.head_dim == head_dim && i.block_size == block_size) return &i;
  }
  return nullptr;
}

bool head_dim_built(DType dtype, int head_dim) {
  for (const ExtendInstance& i : kInstances) {
    if (i.dtype == dtype && i.head_dim == head_dim) return true;
  }
  return false;
}

// "" for FP16 (the messages it always had), " for bfloat16" otherwise.
std::string type_suffix(DType dtype) { return dtype == DType::F16 ? "" : " for " + to_string(dtype); }

}  // namespace

bool extend_built(DType dtype, int head_dim, int block_size) {
  return find_instance(dtype, head_dim, block_size) != nullptr;
}

void check_extend_supported(DType dtype, int head_dim, int block_size) {
  if (!head_dim_built(dtype, head_dim)) {
    throw InvalidArgument("Unsupported head_dim: " + std::to_string(head_dim) + type_suffix(dtype));
  }
  if (find_instance(dtype, head_dim, block_size) == nullptr) {
    throw InvalidArgument("Unsupported block_size: " + std::to_string(block_size) + type_suffix(dtype));
  }
}

int launch_extend(const ExtendParams& params, DType dtype, int head_dim, int block_size, int grid,
                  cudaStream_t stream) {
  if (const ExtendInstance* instance = find_instance(dtype, head_dim, block_size)) {
    return instance->launch(params, grid, stream);
  }
  check_extend_supported(dtype, head_dim, block_size);  // throws for every unbuilt shape
  throw InvalidArgument("Unsupported extend shape: head_dim " + std::to_string(head_dim) + ", block_size " +
                        std::to_string(block_size) + type_suffix(dtype));
}

}  // namespace mixkv::gpu::detail
