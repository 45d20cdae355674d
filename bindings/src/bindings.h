#pragma once
// The pieces of the module mixkv._core, one concept a file; module.cpp calls
// them in dependency order (a type is registered before a signature uses it).
#include <pybind11/pybind11.h>

namespace mixkv::python {

namespace py = pybind11;

// The metaclass of every class of the module: pybind11's, except that
// Class.__new__ raises AttributeError. Class(...) calls the type's tp_new
// slot and then __init__; Class.__new__(Class) alone would make an object
// without a C++ value, whose first use pybind11 answers with uninitialized
// memory (a crash, not an error). Python subclasses still work: they
// inherit the slot, not the attribute.
py::handle init_only_metaclass();
inline py::metaclass init_only() { return py::metaclass(init_only_metaclass()); }

void bind_errors(py::module_& m);
void bind_prefix_cache(py::module_& m);
void bind_cache_shape(py::module_& m);
void bind_token_layout(py::module_& m);
void bind_precision_plan(py::module_& m);
void bind_kv_cache_manager(py::module_& m);
void bind_host_kv_cache(py::module_& m);
void bind_window_planner(py::module_& m);
void bind_scheduler(py::module_& m);
void bind_cpu_ops(py::module_& ops);
#ifdef MIXKV_PYTHON_CUDA
void bind_cuda_cache(py::module_& cuda);
void bind_cuda_planner(py::module_& cuda);
void bind_cuda_ops(py::module_& ops);
#endif

}  // namespace mixkv::python
