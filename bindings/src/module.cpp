// mixkv._core: the C++ API of mixkv for Python. The package mixkv re-exports
// it; docs/python.md describes it.
#include "bindings.h"

PYBIND11_MODULE(_core, m) {
  using namespace mixkv::python;
  m.doc() = "mixkv: a paged KV cache with per-block precision (FP16/INT4/INT2 pools) implementing WindowQuant.";
  bind_errors(m);
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
