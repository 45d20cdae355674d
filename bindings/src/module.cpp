// mixkv._core: the C++ API of mixkv for Python. The package mixkv re-exports
// it; docs/python.md describes it.
#include <pybind11/eval.h>

#include "bindings.h"

namespace mixkv::python {

py::handle init_only_metaclass() {
  // Created once and kept for the life of the process (a class holds it).
  static const py::handle metaclass = [] {
    py::dict scope;
    scope["__name__"] = "mixkv";
    scope["base"] = py::handle(reinterpret_cast<PyObject*>(py::detail::get_internals().default_metaclass));
    py::exec(R"(
class InitOnlyType(base):
    """pybind11's metaclass without Class.__new__ (an object without __init__ has no C++ value)."""

    def __getattribute__(cls, name):
        if name == "__new__":
            raise AttributeError(
                f"{base.__getattribute__(cls, '__name__')}.__new__ is not available: construct with "
                f"{base.__getattribute__(cls, '__name__')}(...), whose __init__ makes the C++ object")
        return base.__getattribute__(cls, name)
)",
             scope);
    return py::handle(scope["InitOnlyType"]).inc_ref();
  }();
  return metaclass;
}

}  // namespace mixkv::python

PYBIND11_MODULE(_core, m) {
  using namespace mixkv::python;
  m.doc() = "mixkv: a paged KV cache with per-block precision (FP16/INT4/INT2 pools) implementing WindowQuant.";
  bind_errors(m);
  bind_prefix_cache(m);
  bind_cache_shape(m);
  bind_token_layout(m);
  bind_precision_plan(m);
  bind_kv_cache_manager(m);
  bind_host_kv_cache(m);
  bind_window_planner(m);
  bind_scheduler(m);

  py::module_ ops = m.def_submodule(
      "ops", "Cache operations: NumPy arrays with a mixkv.KVCache, CUDA arrays with a mixkv.cuda.DeviceKVCache.");
  bind_cpu_ops(ops);
#ifdef MIXKV_PYTHON_CUDA
  m.attr("built_with_cuda") = true;
  py::module_ cuda = m.def_submodule("cuda", "The CUDA backend: device arena, page tables, decode plan, planner.");
  bind_cuda_cache(cuda);
  bind_cuda_planner(cuda);
  bind_cuda_ops(ops);
#else
  m.attr("built_with_cuda") = false;
#endif
}
