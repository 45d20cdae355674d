#pragma once
// CUDA arrays from torch, CuPy, Numba... through __cuda_array_interface__
// (versions 2 and 3): no copies, no conversions. Every check names the
// function and the argument and throws InvalidArgument (Python ValueError).
// pybind11 has no DLPack caster; the interface dict gives everything needed
// (pointer, typestr, shape, strides) and is what torch and CuPy both export.
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional and std::vector casts

#include "host_arrays.h"
#include "mixkv/core/half.h"

namespace mixkv::python {

// Where the arrays of one call must live and be ordered.
struct CudaContext {
  int device = 0;  // the CUDA device of the cache (or the current one)
  cudaStream_t stream = nullptr;
};

// The caller's stream: `stream` may be an int (a cudaStream_t value), an
// object with .cuda_stream (torch.cuda.Stream) or .ptr (cupy.cuda.Stream), or
// None: then torch's current stream when torch is imported, else CuPy's when
// CuPy is, else the legacy default stream (0).
cudaStream_t stream_arg(py::handle stream);

// The current CUDA device.
int current_device();

// The typestr (__cuda_array_interface__) and name of an element type.
template <class T>
struct CudaElement;
template <>
struct CudaElement<Half> {
  static constexpr const char* typestr = "<f2";
  static constexpr const char* name = "float16";
  static constexpr std::size_t alignment = 16;  // the kernels load K/V/q rows 16 bytes at a time
};
template <>
struct CudaElement<float> {
  static constexpr const char* typestr = "<f4";
  static constexpr const char* name = "float32";
  static constexpr std::size_t alignment = 16;
};
template <>
struct CudaElement<std::int32_t> {
  static constexpr const char* typestr = "<i4";
  static constexpr const char* name = "int32";
  static constexpr std::size_t alignment = 4;  // so that a row of AppendResult.slots can be passed as is
};

// A checked CUDA array: its device pointer and shape.
struct CudaArray {
  void* data = nullptr;
  std::vector<py::ssize_t> shape;
};

// Checks that `obj` exports __cuda_array_interface__ with one of `typestrs`
// (named `dtype` in messages), a shape matching `dims`, C-contiguous strides,
// device memory of ctx.device starting on an `alignment`-byte boundary
// (writable when `writable`). When the interface
// names a producer stream (version 3) other than ctx.stream, ctx.stream is
// made to wait for it, as the protocol asks of consumers. Returns the type
// string found.
CudaArray check_cuda_array(py::handle obj, std::string_view where, std::span<const char* const> typestrs,
                           const char* dtype, std::span<const Dim> dims, std::size_t alignment, bool writable,
                           const CudaContext& ctx, std::string* typestr_found = nullptr);

// The __cuda_array_interface__ dict of `obj` (InvalidArgument naming `where`
// when it has none), and the shape it gives.
py::dict interface_of(py::handle obj, std::string_view where, const char* dtype);
std::vector<py::ssize_t> cuda_array_shape(py::handle obj, std::string_view where, const char* dtype);

template <class T>
const T* cuda_input(py::handle obj, std::string_view where, std::initializer_list<Dim> dims, const CudaContext& ctx,
                    std::vector<py::ssize_t>* shape = nullptr) {
  const char* const types[] = {CudaElement<T>::typestr};
  CudaArray a = check_cuda_array(obj, where, types, CudaElement<T>::name, {dims.begin(), dims.size()},
                                 CudaElement<T>::alignment, false, ctx);
  if (shape != nullptr) *shape = std::move(a.shape);
  return static_cast<const T*>(a.data);
}

template <class T>
T* cuda_output(py::handle obj, std::string_view where, std::initializer_list<Dim> dims, const CudaContext& ctx) {
  const char* const types[] = {CudaElement<T>::typestr};
  return static_cast<T*>(check_cuda_array(obj, where, types, CudaElement<T>::name, {dims.begin(), dims.size()},
                                          CudaElement<T>::alignment, true, ctx)
                             .data);
}

// An object exporting __cuda_array_interface__ for device memory owned by
// `owner` (kept alive with it): how DeviceKVCache.arena reaches torch.
py::object device_bytes(void* data, std::size_t bytes, py::object owner);

void bind_device_memory(py::module_& cuda);

}  // namespace mixkv::python
