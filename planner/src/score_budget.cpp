#include "mixkv/planner/score_budget.h"

#include <cmath>
#include <cstdint>
#include <queue>
#include <string>

#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

void require_error(double value, const char* name) {
  if (!std::isfinite(value) || value < 0.0) {
    throw InvalidArgument(std::string(name) + " = " + std::to_string(value) + ", expected a finite value >= 0");
  }
}

void validate_scores(std::span<const std::vector<float>> scores, std::int32_t layers, std::int32_t windows) {
  if (static_cast<std::int64_t>(scores.size()) != layers) {
    throw InvalidArgument("scores: " + std::to_string(scores.size()) + " rows, expected one per layer (" +
                          std::to_string(layers) + ", shape.num_layers)");
  }
  for (std::size_t l = 0; l < scores.size(); ++l) {
    const std::string row = "scores[" + std::to_string(l) + "]";
    if (static_cast<std::int64_t>(scores[l].size()) != windows) {
      throw InvalidArgument(row + ": " + std::to_string(scores[l].size()) + " scores, expected one per window (" +
                            std::to_string(windows) + ", layout.num_windows(shape.block_size))");
    }
    for (std::size_t w = 0; w < scores[l].size(); ++w) {
      const float s = scores[l][w];
      if (!std::isfinite(s) || s < 0.0f) {
        throw InvalidArgument(row + "[" + std::to_string(w) + "] = " + std::to_string(s) +
                              ", expected a finite score >= 0 (e.g. an attention mass)");
      }
    }
  }
}

// One upgrade of one (layer, window) by one precision step.
struct Step {
  double gain_per_byte;
  std::int32_t layer;
  std::int32_t window;
  Precision target;
};

// Largest gain per byte first; equal gains to the lower layer, then the lower window.
struct Later {
  bool operator()(const Step& a, const Step& b) const {
    if (a.gain_per_byte != b.gain_per_byte) return a.gain_per_byte < b.gain_per_byte;
    if (a.layer != b.layer) return a.layer > b.layer;
    return a.window > b.window;
  }
};

}  // namespace

ScoredBudgetPlan plan_from_layer_scores_within_budget(const TokenLayout& layout,
                                                      std::span<const std::vector<float>> scores,
                                                      const CacheShape& shape, double budget_ratio,
                                                      const ScoreBudgetConfig& config) {
  validate(shape);
  if (!std::isfinite(budget_ratio) || budget_ratio <= 0.0) {
    throw InvalidArgument("budget_ratio = " + std::to_string(budget_ratio) + ", expected a finite value > 0");
  }
  require_error(config.int4_error, "config.int4_error");
  require_error(config.int2_error, "config.int2_error");
  if (config.int2_error < config.int4_error) {
    throw InvalidArgument("config.int2_error = " + std::to_string(config.int2_error) +
                          ", expected >= config.int4_error (" + std::to_string(config.int4_error) + ")");
  }
  const std::int32_t layers = shape.num_layers;
  const std::int32_t windows = layout.num_windows(shape.block_size);
  validate_scores(scores, layers, windows);

  PrecisionPlan plan(layers, windows, Precision::INT2);
  for (std::int32_t w = 0; w < windows; ++w) {
    double sum = 0.0;
    for (std::int32_t l = 0; l < layers; ++l) sum += scores[static_cast<std::size_t>(l)][static_cast<std::size_t>(w)];
    plan.set_score(w, static_cast<float>(sum / layers));
  }
  const bool pin_first = config.first_window_fp16 && windows > 0;
  if (pin_first) {
    for (std::int32_t l = 0; l < layers; ++l) plan.set(l, 0, Precision::FP16);
  }
  PlanStats start = plan_stats(layout, plan, shape);
  const double budget_bytes = budget_ratio * static_cast<double>(start.fp16_bytes);

  // Each quantized window owns one block of its pool, and an FP16 window adds
  // exactly one FP16 block (its 32 tokens join the densely packed FP16 run),
  // so every step has a fixed byte cost.
  const auto block_bytes = [&](Precision p) {
    return BlockFormat{p, shape.num_kv_heads, shape.head_dim, shape.block_size}.block_bytes();
  };
  const std::size_t to_int4 = block_bytes(Precision::INT4) - block_bytes(Precision::INT2);
  const std::size_t to_fp16 = block_bytes(Precision::FP16) - block_bytes(Precision::INT4);
  const double int4_gain = config.int2_error - config.int4_error;
  const double fp16_gain = config.int4_error;

  std::priority_queue<Step, std::vector<Step>, Later> steps;
  for (std::int32_t l = 0; l < layers; ++l) {
    for (std::int32_t w = pin_first ? 1 : 0; w < windows; ++w) {
      const double s = scores[static_cast<std::size_t>(l)][static_cast<std::size_t>(w)];
      steps.push({s * int4_gain / static_cast<double>(to_int4), l, w, Precision::INT4});
    }
  }
  std::size_t bytes = start.bytes;
  while (!steps.empty()) {
    const Step step = steps.top();
    steps.pop();
    const std::size_t cost = step.target == Precision::INT4 ? to_int4 : to_fp16;
    if (static_cast<double>(bytes + cost) > budget_bytes) continue;
    bytes += cost;
    plan.set(step.layer, step.window, step.target);
    if (step.target == Precision::INT4) {
      const double s = scores[static_cast<std::size_t>(step.layer)][static_cast<std::size_t>(step.window)];
      steps.push({s * fp16_gain / static_cast<double>(to_fp16), step.layer, step.window, Precision::FP16});
    }
  }
  ScoredBudgetPlan result{std::move(plan), {}};
  result.stats = plan_stats(layout, result.plan, shape);
  if (result.stats.bytes != bytes) {
    throw InvariantViolation("plan_from_layer_scores_within_budget: counted " + std::to_string(bytes) +
                             " bytes, plan_stats gives " + std::to_string(result.stats.bytes));
  }
  return result;
}

}  // namespace mixkv
