#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "mixkv/core/cache_shape.h"
#include "mixkv/core/precision.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv {

// A plan fitted to a KV byte budget by whole-layer floors: what an engine
// with a memory target does with a ranking of its layers by sensitivity (a
// calibration's measured loss, or a per-request measure such as
// docs/real-model.md's question attention error). Starting from `plan`, the
// layers of `layer_order` (most sensitive first) are raised in turn so that
// none of their windows is below `floor`, as long as the plan's bytes
// (plan_stats) stay within budget_ratio x the all-FP16 bytes. The first layer
// that does not fit ends the walk: a layer is never floored while a more
// sensitive one is not. Windows already at `floor` or above are unchanged,
// and so are the scores.
struct BudgetedPlan {
  PrecisionPlan plan;
  std::vector<std::int32_t> floored_layers;  // the prefix of layer_order that fit
  PlanStats stats;                           // of plan; above the budget only if `plan` already was
};

// Throws InvalidArgument naming the argument, and changes nothing, for: a plan
// that does not match layout and shape (plan_stats's checks); floor not a
// valid precision; budget_ratio not finite or <= 0; a layer of layer_order
// outside [0, shape.num_layers) or listed twice.
BudgetedPlan floor_layers_within_budget(const TokenLayout& layout, const PrecisionPlan& plan, const CacheShape& shape,
                                        std::span<const std::int32_t> layer_order, Precision floor,
                                        double budget_ratio);

}  // namespace mixkv
