#include "decode_dispatch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {
namespace {

struct DecodeInstance {
  DType dtype;
  int head_dim;
  int block_size;
  int n_tiles;
  int (*launch)(const DecodeParams& params, int grid, cudaStream_t stream);
};

// The built instances: decode_instances.inc is written by kernels/CMakeLists.txt
// from its instance list, one MIXKV_DECODE_INSTANCE(dtype, type, D, S, NT) a
// line.
constexpr DecodeInstance kInstances[] = {
#define MIXKV_DECODE_INSTANCE(T, E, D, S, NT) {DType::T, D, S, NT, &launch_decode_kernel<E, D, S, NT>},
#include "decode_instances.inc"
#undef MIXKV_DECODE_INSTANCE
};

const DecodeInstance* find_instance(DType dtype, int head_dim, int block_size, int n_tiles) {
  for (const DecodeInstance& i : kInstances) {
    if (i.dtype == dtype && i.head_dim == head_dim && i.block_size == block_size && i.n_tiles == n_tiles) return &i;
  }
  return nullptr;
}

bool head_dim_built(DType dtype, int head_dim) {
  for (const DecodeInstance& i : kInstances) {
    if (i.dtype == dtype && i.head_dim == head_dim) return true;
  }
  return false;
}

// "" for FP16 (the messages it always had), " for bfloat16" otherwise.
std::string type_suffix(DType dtype) { return dtype == DType::F16 ? "" : " for " + to_string(dtype); }

}  // namespace

void check_decode_supported(DType dtype, int head_dim, int block_size) {
  if (!head_dim_built(dtype, head_dim)) {
    throw InvalidArgument("Unsupported head_dim: " + std::to_string(head_dim) + type_suffix(dtype));
  }
  if (find_instance(dtype, head_dim, block_size, 1) == nullptr) {
    throw InvalidArgument("Unsupported block_size: " + std::to_string(block_size) + type_suffix(dtype));
  }
}

bool decode_built(DType dtype, int head_dim, int block_size, int n_tiles) {
  return find_instance(dtype, head_dim, block_size, n_tiles) != nullptr;
}

int launch_decode(const DecodeParams& params, DType dtype, int head_dim, int block_size, int n_tiles, int grid,
                  cudaStream_t stream) {
  if (const DecodeInstance* instance = find_instance(dtype, head_dim, block_size, n_tiles)) {
    return instance->launch(params, grid, stream);
  }
  check_decode_supported(dtype, head_dim, block_size);  // throws for an unbuilt head_dim or block size
  throw InvalidArgument("Unsupported head tiles: " + std::to_string(n_tiles) + " at head_dim " +
                        std::to_string(head_dim) + type_suffix(dtype));
}

}  // namespace mixkv::gpu::detail
