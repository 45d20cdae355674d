#pragma once
// Arrays of any Python array library as TensorViews, without copies. In
// order of preference: a DLPack capsule itself ("dltensor", as
// torch.utils.dlpack.to_dlpack makes it, its producer's writes already
// ordered for the call's stream), DLPack (__dlpack__: NumPy >= 1.22, torch
// on CPU and CUDA, CuPy, JAX), __cuda_array_interface__ (Numba and older CuPy), the
// buffer protocol (NumPy arrays DLPack refuses, such as read-only ones,
// memoryview, array.array). Every check names the function and the argument
// and throws InvalidArgument (Python ValueError):
//   "Engine.attend: q: expected a C-contiguous float16 array on cpu, got float32"
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pybind11/pybind11.h>

#include "mixkv/core/tensor_view.h"

struct DLManagedTensor;

namespace mixkv::python {

namespace py = pybind11;

// What a call expects of one array argument.
struct ArrayExpect {
  std::vector<DType> dtypes;  // accepted element types; messages name them all
  DeviceKind device = DeviceKind::CPU;
  std::int32_t device_id = 0;  // the CUDA device ordinal (CUDA only)
  bool writable = false;       // refused when the producer says it is read-only
  // The stream the call will read the array on (a cudaStream_t value; 0 is
  // the legacy default stream): handed to a CUDA producer's __dlpack__ so
  // that it orders its pending writes before that stream's next work.
  std::intptr_t stream = 0;
};

// An array borrowed for one call: view() is valid while this object lives.
// It holds the DLPack tensor (its deleter runs on destruction, as the
// protocol asks of the consumer), or the buffer, or the object itself.
// Destroy it with the GIL held.
class BorrowedArray {
 public:
  BorrowedArray() = default;
  BorrowedArray(BorrowedArray&& other) noexcept;
  BorrowedArray& operator=(BorrowedArray&& other) noexcept;
  BorrowedArray(const BorrowedArray&) = delete;
  BorrowedArray& operator=(const BorrowedArray&) = delete;
  ~BorrowedArray();

  const TensorView& view() const { return view_; }
  // How it crossed: "dlpack", "cuda_array_interface" or "buffer".
  const char* protocol() const { return protocol_; }

 private:
  friend BorrowedArray borrow_array(py::handle, std::string_view, std::string_view, const ArrayExpect&);
  friend void take_capsule(py::handle, std::string_view, std::string_view, const ArrayExpect&, BorrowedArray&);
  void release() noexcept;

  TensorView view_;
  const char* protocol_ = "";
  DLManagedTensor* managed_ = nullptr;
  Py_buffer buffer_{};
  bool has_buffer_ = false;
  py::object owner_;
};

// Borrows `obj` as a C-contiguous array of one of expect.dtypes on
// expect.device, of at most 4 dimensions. InvalidArgument naming "fn: arg"
// otherwise; nothing is kept from a failed call.
BorrowedArray borrow_array(py::handle obj, std::string_view fn, std::string_view arg, const ArrayExpect& expect);

// "(3, 28, 128)", "(5,)".
std::string shape_text(std::span<const std::int64_t> values);
// "float16", "bfloat16", "float32", "int32".
const char* dtype_name(DType t);
// "cpu", "cuda:0".
std::string device_name(DeviceKind device, std::int32_t device_id);
// A short name of a Python object's type for messages ("torch.Tensor").
std::string object_type_name(py::handle obj);

}  // namespace mixkv::python
