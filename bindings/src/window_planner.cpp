// WindowQuant's planner (window_planner.h): eq. 8 similarity, eq. 9 layer
// sensitivity, eqs. 10-11 thresholds, the precision rule, the batch vote and
// plan statistics. Embeddings are 2-D C-contiguous NumPy arrays of float32,
// float16 or bfloat16 (ml_dtypes); the C++ code reads them in place, without
// the GIL.
#include <string>
#include <vector>

#include <pybind11/native_enum.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "host_arrays.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/plan_budget.h"
#include "mixkv/planner/score_budget.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv::python {
namespace {

// The view of one embeddings matrix; `keep` holds the arrays it points into.
EmbeddingsView embeddings_view(py::handle obj, const std::string& where, std::vector<py::object>& keep) {
  if (!py::isinstance<py::array>(obj)) {
    throw InvalidArgument(where + ": expected a 2-D NumPy array of float32, float16 or bfloat16, got " +
                          type_name(obj));
  }
  const auto a = py::reinterpret_borrow<py::array>(obj);
  const std::string dtype = py::str(a.dtype().attr("name"));
  ElementType type;
  if (dtype == "float32") {
    type = ElementType::F32;
  } else if (dtype == "float16") {
    type = ElementType::F16;
  } else if (dtype == "bfloat16") {
    type = ElementType::BF16;
  } else {
    throw InvalidArgument(where + ": expected dtype float32, float16 or bfloat16, got " + dtype);
  }
  const py::array checked =
      check_host_array(a, where, dtype.c_str(), std::vector<Dim>{{kAny, "tokens"}, {kAny, "hidden"}}, false);
  keep.push_back(checked);
  return {checked.data(), type, checked.shape(0), static_cast<std::int32_t>(checked.shape(1))};
}

std::vector<EmbeddingsView> embeddings_views(const py::sequence& list, const std::string& where,
                                             std::vector<py::object>& keep) {
  std::vector<EmbeddingsView> views;
  for (std::size_t i = 0; i < list.size(); ++i) {
    views.push_back(embeddings_view(list[i], where + "[" + std::to_string(i) + "]", keep));
  }
  return views;
}

}  // namespace

void bind_window_planner(py::module_& m) {
  py::native_enum<SensitivityReduction>(m, "SensitivityReduction", "enum.IntEnum",
                                        "How eq. 9 reduces a [tokens, hidden] pair of hidden states to one cosine.")
      .value("Flattened", SensitivityReduction::Flattened, "eq. 9 as written, on the flattened matrices")
      .value("TokenMean", SensitivityReduction::TokenMean, "the mean over tokens of each token's cosine")
      .finalize();
  py::native_enum<BatchPolicy>(m, "BatchPolicy", "enum.IntEnum", "How a batch's plans relate.")
      .value("PerRequest", BatchPolicy::PerRequest, "each request keeps its own plan")
      .value("MajorityVote", BatchPolicy::MajorityVote, "every (layer, window) takes the precision most chose")
      .finalize();

  py::class_<LayerThresholds>(m, "LayerThresholds", init_only(), "T_low <= T_high of one layer (eqs. 10-11).")
      .def_readonly("low", &LayerThresholds::low)
      .def_readonly("high", &LayerThresholds::high)
      .def(py::self == py::self)
      .def("__repr__", [](const LayerThresholds& t) {
        return "LayerThresholds(low=" + std::string(py::repr(py::float_(t.low))) +
               ", high=" + std::string(py::repr(py::float_(t.high))) + ")";
      });

  py::class_<PlannerConfig>(m, "PlannerConfig", init_only(), "Configuration of a WindowPlanner.")
      .def(py::init([](std::vector<double> sensitivities, std::int32_t window_size, double alpha,
                       std::vector<Precision> min_precision, BatchPolicy batch_policy) {
             return PlannerConfig{window_size, alpha, std::move(sensitivities), std::move(min_precision), batch_policy};
           }),
           py::arg("sensitivities"), py::arg("window_size") = 32, py::arg("alpha") = 2.0,
           py::arg("min_precision") = std::vector<Precision>{}, py::arg("batch_policy") = BatchPolicy::PerRequest)
      .def_readwrite("window_size", &PlannerConfig::window_size, "= CacheShape.block_size of the cache it feeds")
      .def_readwrite("alpha", &PlannerConfig::alpha, "eqs. 10-11; > 0, larger gives a wider INT4 band")
      .def_readwrite("sensitivities", &PlannerConfig::sensitivities, "s_l per layer (eq. 9), each in [-1, 1]")
      .def_readwrite("min_precision", &PlannerConfig::min_precision, "empty, or the lowest precision allowed per layer")
      .def_readwrite("batch_policy", &PlannerConfig::batch_policy);

  py::class_<WindowPlanner>(m, "WindowPlanner", init_only(),
                            "Plans requests (WindowQuant section 1): from prompt embeddings to the PrecisionPlan that "
                            "KVCacheManager.add_sequence allocates. Stateless after construction.")
      .def(py::init<PlannerConfig>(), py::arg("config"),
           "Raises ValueError naming the field of an invalid configuration.")
      .def_property_readonly(
          "config", [](const WindowPlanner& self) -> PlannerConfig { return self.config(); },
          "A copy: editing it changes nothing here (configure a new object with it).")
      .def_property_readonly("num_layers", &WindowPlanner::num_layers)
      .def_property_readonly(
          "thresholds",
          [](const WindowPlanner& p) {
            return std::vector<LayerThresholds>(p.thresholds().begin(), p.thresholds().end());
          },
          "T_low / T_high per layer.")
      .def(
          "plan_from_scores",
          [](const WindowPlanner& p, const std::vector<float>& scores) { return p.plan_from_scores(scores); },
          py::arg("scores"), "The precision rule applied to given eq. 8 scores, one per window in prompt order.")
      .def(
          "plan_from_layer_scores",
          [](const WindowPlanner& p, const std::vector<std::vector<float>>& scores) {
            return p.plan_from_layer_scores(scores);
          },
          py::arg("scores"),
          "The same rule with one score per (layer, window): scores[l][i] (a list of lists or a 2-D array "
          "[num_layers, num_windows]) decides window i of layer l against layer l's thresholds, e.g. similarities "
          "a model gives per layer. The plan's per-window score (demotion order) is the mean over layers.")
      .def(
          "plan",
          [](const WindowPlanner& p, const TokenLayout& layout, py::handle embeddings) {
            std::vector<py::object> keep;
            const EmbeddingsView view = embeddings_view(embeddings, "plan: embeddings", keep);
            py::gil_scoped_release release;
            return p.plan(layout, view);
          },
          py::arg("layout"), py::arg("embeddings"),
          "Similarity, thresholds and rule for one request; embeddings [layout.num_tokens, hidden].")
      .def(
          "plan",
          [](const WindowPlanner& p, const std::vector<TokenLayout>& layouts, const py::sequence& embeddings) {
            std::vector<py::object> keep;
            const auto views = embeddings_views(embeddings, "plan: embeddings", keep);
            py::gil_scoped_release release;
            return p.plan(layouts, views);
          },
          py::arg("layouts"), py::arg("embeddings"), "The same for a batch, honouring config.batch_policy.");

  m.def(
      "window_similarity",
      [](const TokenLayout& layout, py::handle embeddings, std::int32_t window_size) {
        std::vector<py::object> keep;
        const EmbeddingsView view = embeddings_view(embeddings, "window_similarity: embeddings", keep);
        py::gil_scoped_release release;
        return window_similarity(layout, view, window_size);
      },
      py::arg("layout"), py::arg("embeddings"), py::arg("window_size"),
      "Eq. 8 for every full visual window of one request: the mean cosine over all (text token, window token) "
      "pairs. Returns one float per window.");
  m.def(
      "window_similarity",
      [](const std::vector<TokenLayout>& layouts, const py::sequence& embeddings, std::int32_t window_size) {
        std::vector<py::object> keep;
        const auto views = embeddings_views(embeddings, "window_similarity: embeddings", keep);
        py::gil_scoped_release release;
        return window_similarity(layouts, views, window_size);
      },
      py::arg("layouts"), py::arg("embeddings"), py::arg("window_size"),
      "The same for a batch of requests sharing one hidden size.");
  m.def(
      "layer_sensitivity",
      [](const py::sequence& before, const py::sequence& after, SensitivityReduction reduction) {
        std::vector<py::object> keep;
        const auto b = embeddings_views(before, "layer_sensitivity: before", keep);
        const auto a = embeddings_views(after, "layer_sensitivity: after", keep);
        py::gil_scoped_release release;
        return layer_sensitivity(b, a, reduction);
      },
      py::arg("before"), py::arg("after"), py::arg("reduction") = SensitivityReduction::Flattened,
      "Eq. 9 per layer: the cosine between the hidden states before[l] and after[l] of layer l's attention, all of "
      "one shape [tokens, hidden]. Measure once on calibration prompts; pass to PlannerConfig.sensitivities.");
  m.def(
      "majority_vote",
      [](const std::vector<PrecisionPlan*>& plans) {
        // The vote needs the plans side by side; the results go back into the caller's objects.
        std::vector<PrecisionPlan> copies;
        for (std::size_t i = 0; i < plans.size(); ++i) {
          if (plans[i] == nullptr) {
            throw InvalidArgument("majority_vote: plans[" + std::to_string(i) + "] is None, expected a PrecisionPlan");
          }
          copies.push_back(*plans[i]);
        }
        majority_vote(copies);
        for (std::size_t i = 0; i < copies.size(); ++i) *plans[i] = std::move(copies[i]);
      },
      py::arg("plans"),
      "In place, as the C++ call: every (layer, window position) takes the precision most plans chose (ties to "
      "the more precise). Raises ValueError, changing nothing, when the plans differ in layers.");

  py::class_<PlanStats>(m, "PlanStats", init_only(),
                        "What a plan costs in the cache: exactly what add_sequence allocates.")
      .def_readonly("layer_blocks", &PlanStats::layer_blocks, "[layer][FP16, INT4, INT2] blocks")
      .def_readonly("blocks", &PlanStats::blocks, "[FP16, INT4, INT2] blocks over all layers (= demand)")
      .def_readonly("pool_bytes", &PlanStats::pool_bytes)
      .def_readonly("bytes", &PlanStats::bytes, "all pools")
      .def_readonly("fp16_bytes", &PlanStats::fp16_bytes, "the same prompt with every block FP16")
      .def("compression", &PlanStats::compression, "fp16_bytes / bytes");
  m.def("plan_stats", &plan_stats, py::arg("layout"), py::arg("plan"), py::arg("shape"),
        "Blocks and bytes a plan costs. Raises ValueError for a plan that does not match the shape and layout.");

  py::class_<BudgetedPlan>(m, "BudgetedPlan", init_only(), "A plan fitted to a KV byte budget by whole-layer floors.")
      .def_readonly("plan", &BudgetedPlan::plan)
      .def_readonly("floored_layers", &BudgetedPlan::floored_layers, "the prefix of layer_order that fit")
      .def_readonly("stats", &BudgetedPlan::stats, "plan_stats of plan");
  m.def(
      "floor_layers_within_budget",
      [](const TokenLayout& layout, const PrecisionPlan& plan, const CacheShape& shape,
         const std::vector<std::int32_t>& layer_order, Precision floor, double budget_ratio) {
        return floor_layers_within_budget(layout, plan, shape, layer_order, floor, budget_ratio);
      },
      py::arg("layout"), py::arg("plan"), py::arg("shape"), py::arg("layer_order"), py::arg("floor"),
      py::arg("budget_ratio"),
      "A new plan: the layers of layer_order (most sensitive first) raised in turn so that none of their windows "
      "is below floor, while plan_stats' bytes stay within budget_ratio x the all-FP16 bytes; the first layer "
      "that does not fit ends the walk. Raises ValueError naming the argument (a plan not matching layout and "
      "shape, budget_ratio not finite or <= 0, a layer out of range or listed twice); the input plan is not "
      "changed.");

  py::class_<ScoreBudgetConfig>(m, "ScoreBudgetConfig", init_only(),
                                "Error weights of plan_from_layer_scores_within_budget.")
      .def(py::init([](double int4_error, double int2_error, bool first_window_fp16) {
             return ScoreBudgetConfig{int4_error, int2_error, first_window_fp16};
           }),
           py::arg("int4_error") = 0.1, py::arg("int2_error") = 0.5, py::arg("first_window_fp16") = true)
      .def_readwrite("int4_error", &ScoreBudgetConfig::int4_error, "relative error of a window stored INT4")
      .def_readwrite("int2_error", &ScoreBudgetConfig::int2_error, "relative error of a window stored INT2")
      .def_readwrite("first_window_fp16", &ScoreBudgetConfig::first_window_fp16,
                     "window 0 FP16 in every layer (attention sinks)");
  py::class_<ScoredBudgetPlan>(m, "ScoredBudgetPlan", init_only(),
                               "A plan fitted to a KV byte budget from per-(layer, window) scores.")
      .def_readonly("plan", &ScoredBudgetPlan::plan)
      .def_readonly("stats", &ScoredBudgetPlan::stats, "plan_stats of plan");
  m.def(
      "plan_from_layer_scores_within_budget",
      [](const TokenLayout& layout, const std::vector<std::vector<float>>& scores, const CacheShape& shape,
         double budget_ratio, const ScoreBudgetConfig& config) {
        return plan_from_layer_scores_within_budget(layout, scores, shape, budget_ratio, config);
      },
      py::arg("layout"), py::arg("scores"), py::arg("shape"), py::arg("budget_ratio"),
      py::arg("config") = ScoreBudgetConfig{},
      "A plan from a score per (layer, window) (scores[l][i], a list of lists or a 2-D array [num_layers, "
      "num_windows], each >= 0, e.g. the attention mass the question pays window i at layer l): every window "
      "starts INT2 (window 0 FP16), then the upgrade of largest score x error saved per byte is taken while "
      "plan_stats' bytes stay within budget_ratio x the all-FP16 bytes. Raises ValueError naming the argument.");
}

}  // namespace mixkv::python
