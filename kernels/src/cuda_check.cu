#include "cuda_check.cuh"

#include <sstream>

namespace mixkv::gpu::detail {

void throw_cuda_error(cudaError_t status, const char* what, const char* file, int line) {
  std::ostringstream message;
  message << what << " failed: " << cudaGetErrorName(status) << " (" << cudaGetErrorString(status) << ") at "
          << file << ":" << line;
  // A failed cudaMalloc also sets the runtime's last error; clear it, or the
  // next launch check would report this allocation as its own failure.
  static_cast<void>(cudaGetLastError());
  if (status == cudaErrorMemoryAllocation) throw OutOfMemory(message.str());
  throw DeviceError(message.str());
}

}  // namespace mixkv::gpu::detail
