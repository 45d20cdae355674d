#pragma once
// CUDA error handling of the CUDA backend and the GPU planner (a detail
// header: not part of the API). Every runtime call goes through these so that
// a failure surfaces as mixkv::DeviceError (OutOfMemory for an allocation)
// naming the call and its file and line, never as an ignored status.
#include <cuda_runtime.h>

#include <concepts>
#include <string>

#include "mixkv/core/errors.h"

namespace mixkv::gpu::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* what, const char* file, int line);

inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) throw_cuda_error(status, what, file, line);
}

// Throws InvalidArgument with `message` unless `condition`.
inline void require(bool condition, const char* message) {
  if (!condition) throw InvalidArgument(message);
}

// The same with a message that has to be built (a lambda returning it),
// built only on failure: these checks run on every call (a decode run per
// layer, a store per prefill, set_blocks per block), where building the
// strings each time cost microseconds of host time. There is deliberately
// no std::string overload, so that a built message cannot be passed eagerly.
template <std::invocable MakeMessage>
inline void require(bool condition, MakeMessage&& make_message) {
  if (!condition) throw InvalidArgument(make_message());
}

}  // namespace mixkv::gpu::detail

#define MIXKV_CUDA_CHECK(call) ::mixkv::gpu::detail::check_cuda((call), #call, __FILE__, __LINE__)
// After a launch: configuration errors show up in cudaGetLastError (no sync).
#define MIXKV_CUDA_CHECK_LAUNCH(name) \
  ::mixkv::gpu::detail::check_cuda(cudaGetLastError(), "launch of " name, __FILE__, __LINE__)
