// PrecisionPlan: the precision of every (layer, visual window) of a request.
#include <string>

#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "mixkv/core/precision_plan.h"

namespace mixkv::python {

void bind_precision_plan(py::module_& m) {
  py::class_<PrecisionPlan>(m, "PrecisionPlan", init_only(),
                            "Precision of every (layer, visual window) of one request, with the eq. 8 score per "
                            "window that chose it. Tokens outside full windows are FP16 and not part of the plan.")
      .def(py::init<>(), "An empty plan (0 layers, 0 windows).")
      .def(py::init<std::int32_t, std::int32_t, Precision>(), py::arg("num_layers"), py::arg("num_windows"),
           py::arg("fill") = Precision::FP16,
           "Every window at `fill`, scores 0. Raises ValueError for num_layers < 1 or num_windows < 0.")
      .def_property_readonly("num_layers", &PrecisionPlan::num_layers)
      .def_property_readonly("num_windows", &PrecisionPlan::num_windows)
      .def("at", &PrecisionPlan::at, py::arg("layer"), py::arg("window"), "Raises IndexError naming layer or window.")
      .def("set", &PrecisionPlan::set, py::arg("layer"), py::arg("window"), py::arg("precision"))
      .def("score", &PrecisionPlan::score, py::arg("window"))
      .def("set_score", &PrecisionPlan::set_score, py::arg("window"), py::arg("score"))
      .def("window_counts", &PrecisionPlan::window_counts, py::arg("layer"),
           "Windows of a layer at each precision, indexed by pool index: [FP16, INT4, INT2].")
      .def(py::self == py::self)
      .def("__repr__", [](const PrecisionPlan& p) {
        return "PrecisionPlan(num_layers=" + std::to_string(p.num_layers()) +
               ", num_windows=" + std::to_string(p.num_windows()) + ")";
      });
}

}  // namespace mixkv::python
