#include "cuda_check.cuh"

#include <sstream>

namespace mixkv::gpu::detail {

void throw_cuda_error(cudaError_t status, const char* what, const char* file, int line) {
  std::ostringstream message;
  message << what << " failed: " << cudaGetErrorName(status) << " (" << cudaGetErrorString(status) << ") at "
          << file << ":" << line;
  if (status == cudaErrorMemoryAllocation) throw OutOfMemory(message.str());
  throw DeviceError(message.str());
}

}  // namespace mixkv::gpu::detail
