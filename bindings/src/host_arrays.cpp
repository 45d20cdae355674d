#include "host_arrays.h"

#include <cstring>
#include <limits>

#include "mixkv/core/errors.h"

namespace mixkv::python {
namespace {

[[noreturn]] void fail(std::string_view where, const std::string& what) {
  throw InvalidArgument(std::string(where) + ": " + what);
}

// A NumPy bool scalar (numpy.bool_): its dtype's kind is 'b'.
bool is_numpy_bool(py::handle obj) {
  if (!py::hasattr(obj, "dtype") || py::isinstance<py::array>(obj)) return false;
  const py::object dtype = obj.attr("dtype");
  return py::hasattr(dtype, "kind") && std::string(py::str(dtype.attr("kind"))) == "b";
}

}  // namespace

std::string dims_text(std::span<const Dim> dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += dims[i].name;
    if (dims[i].size != kAny) s += "=" + std::to_string(dims[i].size);
  }
  return s + ")";
}

std::string type_name(py::handle obj) {
  const py::handle type = py::type::handle_of(obj);
  const std::string module = py::str(type.attr("__module__"));
  const std::string name = py::str(type.attr("__qualname__"));
  return module == "builtins" ? name : module + "." + name;
}

py::array check_host_array(py::handle obj, std::string_view where, const char* dtype, std::span<const Dim> dims,
                           bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    const bool cuda = py::hasattr(obj, "__cuda_array_interface__");
    fail(where, std::string("expected a NumPy ") + dtype + " array, got " + type_name(obj) +
                    (cuda ? " in device memory (a mixkv.KVCache takes NumPy arrays; CUDA arrays go with a "
                            "mixkv.cuda.DeviceKVCache)"
                          : ""));
  }
  auto a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().equal(py::dtype(dtype))) {
    fail(where, std::string("expected dtype ") + dtype + ", got " + std::string(py::str(a.dtype())));
  }
  const std::span<const py::ssize_t> shape(a.shape(), static_cast<std::size_t>(a.ndim()));
  bool match = shape.size() == dims.size();
  for (std::size_t i = 0; match && i < dims.size(); ++i) match = dims[i].size == kAny || dims[i].size == shape[i];
  if (!match) fail(where, "expected shape " + dims_text(dims) + ", got " + shape_text(shape));
  if (!(a.flags() & py::array::c_style)) {
    fail(where, "expected a C-contiguous array (numpy.ascontiguousarray makes one), got strides " +
                    shape_text({a.strides(), static_cast<std::size_t>(a.ndim())}));
  }
  if (reinterpret_cast<std::uintptr_t>(a.data()) % a.itemsize() != 0) {
    fail(where, "expected an aligned array, got data at an address not a multiple of its item size");
  }
  if (writable && !a.writeable()) fail(where, "expected a writable array, got a read-only one");
  return a;
}

py::array_t<float> new_float_array(std::vector<py::ssize_t> shape) { return py::array_t<float>(shape); }

std::vector<std::int32_t> index_vector(py::handle obj, std::string_view where) {
  if (py::isinstance<py::array>(obj)) {
    const HostArray<const std::int32_t> a = input_array<std::int32_t>(obj, where, {{kAny, "n"}});
    return {a.values.begin(), a.values.end()};
  }
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj)) {
    fail(where, "expected an int32 NumPy array or a sequence of int, got " + type_name(obj));
  }
  const auto seq = py::reinterpret_borrow<py::sequence>(obj);
  std::vector<std::int32_t> values;
  values.reserve(seq.size());
  for (std::size_t i = 0; i < seq.size(); ++i) {
    const py::object item = seq[i];
    // operator.index semantics: Python ints and NumPy integer scalars, not
    // floats, and not bools: True is an int to Python, but a slot of True is
    // a bug in the caller, never slot 1.
    if (PyBool_Check(item.ptr()) || (!PyLong_CheckExact(item.ptr()) && is_numpy_bool(item))) {
      throw InvalidArgument(std::string(where) + "[" + std::to_string(i) + "]: expected an int, got " +
                            type_name(item));
    }
    if (!PyIndex_Check(item.ptr())) {
      throw InvalidArgument(std::string(where) + "[" + std::to_string(i) + "]: expected an int, got " +
                            type_name(item));
    }
    const py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(item.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0 || v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max()) {
      throw InvalidArgument(std::string(where) + "[" + std::to_string(i) + "] = " + std::string(py::str(index)) +
                            ": expected a value that fits int32");
    }
    values.push_back(static_cast<std::int32_t>(v));
  }
  return values;
}

py::array_t<std::int32_t> int32_array(std::span<const std::int32_t> values) {
  py::array_t<std::int32_t> a(static_cast<py::ssize_t>(values.size()));
  if (!values.empty()) std::memcpy(a.mutable_data(), values.data(), values.size() * sizeof(std::int32_t));
  return a;
}

}  // namespace mixkv::python
