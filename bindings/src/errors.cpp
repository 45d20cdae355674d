// The typed errors of cache/errors.h as Python exceptions. Each one subclasses
// the built-in exception a Python caller expects (ValueError, MemoryError,
// KeyError, IndexError, RuntimeError), so `except ValueError` works, while
// `except mixkv.InvalidArgument` can be precise. Messages are the C++ ones.
#include "mixkv/core/errors.h"

#include "bindings.h"

namespace mixkv::python {

void bind_errors(py::module_& m) {
  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError).doc() =
      "A malformed argument (shape, dtype, size, precision, plan length, NaN input); a ValueError.";
  py::register_exception<OutOfMemory>(m, "OutOfMemory", PyExc_MemoryError).doc() =
      "A pool (or the arena behind it) cannot provide the blocks a call needs; a MemoryError.";
  py::register_exception<UnknownId>(m, "UnknownId", PyExc_KeyError).doc() =
      "An unknown (or, when adding, an already present) sequence or request id; a KeyError.";
  py::register_exception<IndexOutOfRange>(m, "IndexOutOfRange", PyExc_IndexError).doc() =
      "An index (layer, window, head, block id) outside its range; an IndexError.";
  py::register_exception<InvariantViolation>(m, "InvariantViolation", PyExc_RuntimeError).doc() =
      "check_invariants() found the cache's bookkeeping inconsistent: a bug; a RuntimeError.";
  py::register_exception<DeviceError>(m, "DeviceError", PyExc_RuntimeError).doc() =
      "A CUDA runtime or cuBLAS call failed; a RuntimeError.";
}

}  // namespace mixkv::python
