// The typed errors of cache/errors.h as Python exceptions. Each one subclasses
// the built-in exception a Python caller expects (ValueError, MemoryError,
// KeyError, IndexError, RuntimeError), so `except ValueError` works, while
// `except mixkv.InvalidArgument` can be precise. Messages are the C++ ones.
#include "mixkv/cache/errors.h"

#include "bindings.h"

namespace mixkv::python {

void bind_errors(py::module_& m) {
  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  py::register_exception<OutOfMemory>(m, "OutOfMemory", PyExc_MemoryError);
  py::register_exception<UnknownId>(m, "UnknownId", PyExc_KeyError);
  py::register_exception<IndexOutOfRange>(m, "IndexOutOfRange", PyExc_IndexError);
  py::register_exception<InvariantViolation>(m, "InvariantViolation", PyExc_RuntimeError);
  py::register_exception<DeviceError>(m, "DeviceError", PyExc_RuntimeError);
}

}  // namespace mixkv::python
