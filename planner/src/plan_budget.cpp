#include "mixkv/planner/plan_budget.h"

#include <cmath>
#include <string>

#include "mixkv/core/checks.h"
#include "mixkv/core/errors.h"

namespace mixkv {

BudgetedPlan floor_layers_within_budget(const TokenLayout& layout, const PrecisionPlan& plan, const CacheShape& shape,
                                        std::span<const std::int32_t> layer_order, Precision floor,
                                        double budget_ratio) {
  BudgetedPlan result{plan, {}, plan_stats(layout, plan, shape)};
  detail::require_precision(floor, "floor");
  if (!std::isfinite(budget_ratio) || budget_ratio <= 0.0) {
    throw InvalidArgument("budget_ratio = " + std::to_string(budget_ratio) + ", expected a finite value > 0");
  }
  std::vector<bool> listed(static_cast<std::size_t>(shape.num_layers), false);
  for (std::size_t i = 0; i < layer_order.size(); ++i) {
    const std::int32_t layer = layer_order[i];
    const std::string name = "layer_order[" + std::to_string(i) + "]";
    if (layer < 0 || layer >= shape.num_layers) {
      throw InvalidArgument(name + " = " + std::to_string(layer) + ", expected 0 <= layer < " +
                            std::to_string(shape.num_layers) + " (shape.num_layers)");
    }
    if (listed[static_cast<std::size_t>(layer)]) {
      throw InvalidArgument(name + " = " + std::to_string(layer) + ": listed twice");
    }
    listed[static_cast<std::size_t>(layer)] = true;
  }

  // Floors only ever add bytes, so the budget is checked after each layer.
  const double budget_bytes = budget_ratio * static_cast<double>(result.stats.fp16_bytes);
  PrecisionPlan candidate = plan;
  for (const std::int32_t layer : layer_order) {
    for (std::int32_t w = 0; w < candidate.num_windows(); ++w) {
      if (pool_index(candidate.at(layer, w)) > pool_index(floor)) candidate.set(layer, w, floor);
    }
    PlanStats stats = plan_stats(layout, candidate, shape);
    if (static_cast<double>(stats.bytes) > budget_bytes) break;
    result.plan = candidate;
    result.stats = std::move(stats);
    result.floored_layers.push_back(layer);
  }
  return result;
}

}  // namespace mixkv
