#pragma once
#include <span>
#include <vector>

#include "mixkv/core/cache_shape.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv {

// A plan fitted to a KV byte budget from an importance score per (layer,
// window) that the engine supplies, e.g. the attention mass the prompt's
// last rows (the question: an observation window, as SnapKV uses) pay each
// window at each layer during the dense prefill. Beside eq. 8 and its
// thresholds (WindowPlanner), which score a window once for every layer and
// cannot hit a byte target, this rule spends exactly the bytes it is given
// where the scores say the question looks (docs/planner.md).
//
// The rule minimizes sum over (layer, window) of score x error(precision)
// subject to plan_stats' bytes <= budget_ratio x the all-FP16 bytes, with
// error(FP16) = 0, error(INT4) = int4_error, error(INT2) = int2_error, by
// the greedy of the knapsack's relaxation: every window starts at INT2
// (window 0 at FP16 when first_window_fp16), then the step of largest gain
// per byte is taken while it fits: INT2 -> INT4 gains score x (int2_error -
// int4_error), INT4 -> FP16 gains score x int4_error, each for its exact
// block bytes. A window's INT4 step comes before its FP16 step. A step that
// does not fit is dropped and the walk goes on, so a cheaper INT4 step can
// still use the bytes a FP16 step could not. Equal gains per byte go to the
// lower layer, then the lower window, so the plan is deterministic; windows
// of score 0 still take bytes the others leave (more bits never cost
// accuracy).
struct ScoreBudgetConfig {
  // Relative errors of a window stored INT4 / INT2; only their ratio and the
  // block bytes decide the plan. The defaults are the relative RMS of V
  // quantized per token over a whole head on Gaussian data with outlier
  // channels (docs: testing bars, INT4 0.100 and INT2 0.50).
  double int4_error = 0.1;
  double int2_error = 0.5;
  // Window 0 (the first full visual window) FP16 in every layer, as the
  // threshold rule keeps it: attention sinks.
  bool first_window_fp16 = true;
};

struct ScoredBudgetPlan {
  PrecisionPlan plan;  // the plan's per-window score (demotion order) is the mean over layers
  PlanStats stats;     // plan_stats(plan); above the budget only when the all-INT2 start already is
};

// scores[l][i]: window i of layer l, one row per shape.num_layers, each of
// layout.num_windows(shape.block_size) values. Throws InvalidArgument naming
// the argument, and changes nothing, for: an invalid shape; budget_ratio not
// finite or <= 0; a wrong number of rows or of scores in a row; a score
// that is NaN, infinite or negative; int4_error or int2_error not finite,
// int4_error < 0 or int2_error < int4_error.
ScoredBudgetPlan plan_from_layer_scores_within_budget(const TokenLayout& layout,
                                                      std::span<const std::vector<float>> scores,
                                                      const CacheShape& shape, double budget_ratio,
                                                      const ScoreBudgetConfig& config = {});

}  // namespace mixkv
