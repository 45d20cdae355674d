#pragma once
// NumPy arrays as the CPU backend's spans. Every check names the function and
// the argument ("store_prefill: k: ...") and throws InvalidArgument, which
// Python sees as ValueError; nothing is converted or copied behind the
// caller's back (a float32 K would silently round, an int64 slot could wrap).
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "mixkv/core/half.h"

namespace mixkv::python {

namespace py = pybind11;

// One expected dimension: a fixed size, or kAny; `name` goes into messages.
struct Dim {
  std::int64_t size;
  const char* name;
};
inline constexpr std::int64_t kAny = -1;

// The element types arrays cross with; Half is NumPy's float16 bit for bit.
template <class T>
struct ElementName;
template <>
struct ElementName<Half> {
  static constexpr const char* value = "float16";
};
template <>
struct ElementName<float> {
  static constexpr const char* value = "float32";
};
template <>
struct ElementName<std::int32_t> {
  static constexpr const char* value = "int32";
};
template <>
struct ElementName<std::uint8_t> {
  static constexpr const char* value = "uint8";
};

// "(3, 28, 128)" for messages (the function of dlpack.h: py::ssize_t is
// std::int64_t; defined in dlpack.cpp).
static_assert(std::is_same_v<py::ssize_t, std::int64_t>);
std::string shape_text(std::span<const py::ssize_t> shape);
// "(batch, num_q_heads, head_dim=128)".
std::string dims_text(std::span<const Dim> dims);
// A short name of a Python object's type for messages ("torch.Tensor").
std::string type_name(py::handle obj);

// Checks that `obj` is a C-contiguous, aligned NumPy array of `dtype` whose
// shape matches `dims` (writable when `writable`), and returns it.
py::array check_host_array(py::handle obj, std::string_view where, const char* dtype, std::span<const Dim> dims,
                           bool writable);

// A checked array and the span over its elements (the array keeps them alive).
template <class T>
struct HostArray {
  py::array array;
  std::span<T> values;

  py::ssize_t dim(int i) const { return array.shape(i); }
};

template <class T>
HostArray<const T> input_array(py::handle obj, std::string_view where, std::initializer_list<Dim> dims) {
  py::array a = check_host_array(obj, where, ElementName<T>::value, {dims.begin(), dims.size()}, false);
  const auto* data = static_cast<const T*>(a.data());
  return {a, {data, static_cast<std::size_t>(a.size())}};
}

template <class T>
HostArray<T> output_array(py::handle obj, std::string_view where, std::initializer_list<Dim> dims) {
  py::array a = check_host_array(obj, where, ElementName<T>::value, {dims.begin(), dims.size()}, true);
  auto* data = static_cast<T*>(a.mutable_data());
  return {a, {data, static_cast<std::size_t>(a.size())}};
}

// A new C-contiguous float32 array of `shape` (for outputs the caller did not pass).
py::array_t<float> new_float_array(std::vector<py::ssize_t> shape);

// Block ids / slots: an int32 NumPy array of one dimension, or a sequence of
// Python ints (each checked to fit int32; bools are refused).
std::vector<std::int32_t> index_vector(py::handle obj, std::string_view where);

// Copies of C++ index vectors as NumPy int32 arrays.
py::array_t<std::int32_t> int32_array(std::span<const std::int32_t> values);

}  // namespace mixkv::python
