// mixkv.cuda.CudaWindowPlanner and layer_sensitivity: the WindowQuant planner
// on embeddings in device memory (CUDA float32, float16 or bfloat16 arrays;
// torch exports bfloat16 with typestr '<V2').
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "cuda_arrays.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/cuda_window_planner.h"

namespace mixkv::python {
namespace {

std::vector<EmbeddingsView> device_embeddings(const py::sequence& list, const std::string& where, cudaStream_t stream) {
  static const char* const types[] = {"<f4", "<f2", "<V2"};
  const CudaContext ctx{current_device(), stream};
  std::vector<EmbeddingsView> views;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    std::string typestr;
    const CudaArray a = check_cuda_array(list[i], at, types, "float32, float16 or bfloat16",
                                         std::vector<Dim>{{kAny, "tokens"}, {kAny, "hidden"}}, 2, false, ctx, &typestr);
    const ElementType type =
        typestr == "<f4" ? ElementType::F32 : (typestr == "<f2" ? ElementType::F16 : ElementType::BF16);
    views.push_back({a.data, type, a.shape[0], static_cast<std::int32_t>(a.shape[1])});
  }
  return views;
}

}  // namespace

void bind_cuda_planner(py::module_& cuda) {
  py::class_<gpu::CudaWindowPlanner>(
      cuda, "CudaWindowPlanner", init_only(),
      "WindowPlanner on the GPU: eq. 8 similarity through normalized means, thresholds, the precision rule (and "
      "the majority vote) for a batch of requests whose embeddings are CUDA arrays [tokens, hidden]. Same "
      "decisions as mixkv.WindowPlanner. One batch at a time.")
      .def(py::init<PlannerConfig>(), py::arg("config"))
      .def_property_readonly(
          "config", [](const gpu::CudaWindowPlanner& p) -> PlannerConfig { return p.config(); },
          "A copy: editing it changes nothing here (configure a new object with it).")
      .def_property_readonly("num_layers", &gpu::CudaWindowPlanner::num_layers)
      .def(
          "plan",
          [](gpu::CudaWindowPlanner& p, const std::vector<TokenLayout>& layouts, const py::sequence& embeddings,
             py::handle stream) {
            const cudaStream_t s = stream_arg(stream);
            const auto views = device_embeddings(embeddings, "plan: embeddings", s);
            py::gil_scoped_release release;
            return p.plan(layouts, views, s);
          },
          py::arg("layouts"), py::arg("embeddings"), py::arg("stream") = py::none(),
          "prepare + launch + finish: one PrecisionPlan per request (waits for the stream).")
      .def(
          "prepare",
          [](gpu::CudaWindowPlanner& p, const std::vector<TokenLayout>& layouts, const py::sequence& embeddings,
             py::handle stream) {
            const cudaStream_t s = stream_arg(stream);
            p.prepare(layouts, device_embeddings(embeddings, "prepare: embeddings", s), s);
          },
          py::arg("layouts"), py::arg("embeddings"), py::arg("stream") = py::none(),
          "Validates and uploads the batch's work list. The embeddings must stay alive until finish().")
      .def(
          "launch", [](gpu::CudaWindowPlanner& p, py::handle stream) { p.launch(stream_arg(stream)); },
          py::arg("stream") = py::none(), "Enqueues similarity, thresholds and plan.")
      .def(
          "finish",
          [](gpu::CudaWindowPlanner& p, py::handle stream) {
            const cudaStream_t s = stream_arg(stream);
            py::gil_scoped_release release;
            return p.finish(s);
          },
          py::arg("stream") = py::none(), "Waits for the stream and returns one PrecisionPlan per request.");

  cuda.def(
      "layer_sensitivity",
      [](const py::sequence& before, const py::sequence& after, SensitivityReduction reduction, py::handle stream) {
        const cudaStream_t s = stream_arg(stream);
        const auto b = device_embeddings(before, "layer_sensitivity: before", s);
        const auto a = device_embeddings(after, "layer_sensitivity: after", s);
        py::gil_scoped_release release;
        return gpu::layer_sensitivity(b, a, reduction, s);
      },
      py::arg("before"), py::arg("after"), py::arg("reduction") = SensitivityReduction::Flattened,
      py::arg("stream") = py::none(), "Eq. 9 on the device, as mixkv.layer_sensitivity (waits for the stream).");
}

}  // namespace mixkv::python
