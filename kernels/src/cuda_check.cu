#include "mixkv/kernels/detail/cuda_check.h"

#include <string>

namespace mixkv::gpu::detail {

void throw_cuda_error(cudaError_t status, const char* what, const char* file, int line) {
  const std::string message = std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ") at " + file + ":" + std::to_string(line);
  // A failed cudaMalloc also sets the runtime's last error; clear it, or the
  // next launch check would report this allocation as its own failure.
  static_cast<void>(cudaGetLastError());
  if (status == cudaErrorMemoryAllocation) throw OutOfMemory(message);
  throw DeviceError(message);
}

}  // namespace mixkv::gpu::detail
