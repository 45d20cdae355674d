// floor_layers_within_budget: whole-layer floors in sensitivity order while
// the plan's bytes fit a budget.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/planner/plan_budget.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::F;
using test::I2;
using test::I4;

// 4 text tokens, 5 windows of 16, 3 text tokens; 4 layers.
const TokenLayout kLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 80}, {TokenKind::Text, 3}});
const CacheShape kShape{4, 2, 16, 16};

PrecisionPlan int2_plan() {
  PrecisionPlan plan(4, 5, I2);
  for (std::int32_t l = 0; l < 4; ++l) plan.set(l, 0, F);  // the first window FP16, as the planner keeps it
  for (std::int32_t w = 0; w < 5; ++w) plan.set_score(w, 0.1f * static_cast<float>(w));
  return plan;
}

PrecisionPlan floored(PrecisionPlan plan, const std::vector<std::int32_t>& layers, Precision floor) {
  for (const std::int32_t l : layers) {
    for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
      if (pool_index(plan.at(l, w)) > pool_index(floor)) plan.set(l, w, floor);
    }
  }
  return plan;
}

double ratio(const PrecisionPlan& plan) {
  const PlanStats stats = plan_stats(kLayout, plan, kShape);
  return static_cast<double>(stats.bytes) / static_cast<double>(stats.fp16_bytes);
}

TEST(FloorLayersWithinBudget, FloorsTheLeadingLayersThatFit) {
  const PrecisionPlan plan = int2_plan();
  const std::vector<std::int32_t> order = {2, 0, 3, 1};
  const double two = ratio(floored(plan, {2, 0}, I4));
  const double three = ratio(floored(plan, {2, 0, 3}, I4));
  ASSERT_LT(ratio(plan), two);
  ASSERT_LT(two, three);
  const BudgetedPlan fitted = floor_layers_within_budget(kLayout, plan, kShape, order, I4, 0.5 * (two + three));
  EXPECT_EQ(fitted.floored_layers, (std::vector<std::int32_t>{2, 0}));
  EXPECT_EQ(fitted.plan, floored(plan, {2, 0}, I4));
  const PlanStats stats = plan_stats(kLayout, fitted.plan, kShape);
  EXPECT_EQ(fitted.stats.bytes, stats.bytes);
  EXPECT_EQ(fitted.stats.blocks, stats.blocks);
  EXPECT_EQ(fitted.stats.layer_blocks, stats.layer_blocks);

  // Room for every layer: all floored, in the given order.
  const BudgetedPlan all = floor_layers_within_budget(kLayout, plan, kShape, order, I4, 1.0);
  EXPECT_EQ(all.floored_layers, order);
  EXPECT_EQ(all.plan, floored(plan, order, I4));
}

TEST(FloorLayersWithinBudget, StopsAtTheFirstLayerThatDoesNotFit) {
  // Layer 1 already at INT4 costs nothing to floor, but it comes after layer 3,
  // which does not fit: a less sensitive layer is never floored first.
  PrecisionPlan plan = floored(int2_plan(), {1}, I4);
  const double budget = 0.5 * (ratio(floored(plan, {2}, I4)) + ratio(floored(plan, {2, 3}, I4)));
  const BudgetedPlan fitted =
      floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{2, 3, 1}, I4, budget);
  EXPECT_EQ(fitted.floored_layers, (std::vector<std::int32_t>{2}));
  EXPECT_EQ(fitted.plan, floored(plan, {2}, I4));
}

TEST(FloorLayersWithinBudget, KeepsWindowsAboveTheFloorAndTheScores) {
  PrecisionPlan plan = int2_plan();
  plan.set(1, 3, F);
  plan.set(1, 4, I4);
  const BudgetedPlan fitted = floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{1}, I4, 1.0);
  EXPECT_EQ(fitted.floored_layers, (std::vector<std::int32_t>{1}));
  const std::vector<Precision> row = {F, I4, I4, F, I4};
  for (std::int32_t w = 0; w < 5; ++w) {
    EXPECT_EQ(fitted.plan.at(1, w), row[static_cast<std::size_t>(w)]) << "window " << w;
    EXPECT_EQ(fitted.plan.score(w), plan.score(w));
  }

  // An FP16 floor moves the layer's windows into the FP16 pool.
  const BudgetedPlan fp16 = floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{0}, F, 1.0);
  EXPECT_EQ(fp16.plan.window_counts(0), (std::array<std::int32_t, kNumPrecisions>{5, 0, 0}));
}

TEST(FloorLayersWithinBudget, PlanAlreadyOverTheBudgetComesBackUnchanged) {
  const PrecisionPlan plan = int2_plan();
  const BudgetedPlan fitted =
      floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{0, 1}, I4, 0.5 * ratio(plan));
  EXPECT_TRUE(fitted.floored_layers.empty());
  EXPECT_EQ(fitted.plan, plan);
  EXPECT_GT(static_cast<double>(fitted.stats.bytes), 0.5 * ratio(plan) * static_cast<double>(fitted.stats.fp16_bytes));
  const BudgetedPlan none = floor_layers_within_budget(kLayout, plan, kShape, {}, I4, 1.0);
  EXPECT_TRUE(none.floored_layers.empty());
  EXPECT_EQ(none.plan, plan);
}

TEST(FloorLayersWithinBudget, RejectsBadArgumentsNamingThem) {
  const PrecisionPlan plan = int2_plan();
  const std::vector<std::int32_t> order = {0, 1};
  for (const double bad : {0.0, -0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    expect_error<InvalidArgument>([&] { floor_layers_within_budget(kLayout, plan, kShape, order, I4, bad); },
                                  "budget_ratio");
  }
  expect_error<InvalidArgument>(
      [&] {
        floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{0, 4}, I4, 1.0);
      },
      "layer_order[1] = 4");
  expect_error<InvalidArgument>(
      [&] { floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{-1}, I4, 1.0); },
      "layer_order[0] = -1");
  expect_error<InvalidArgument>(
      [&] {
        floor_layers_within_budget(kLayout, plan, kShape, std::vector<std::int32_t>{2, 1, 2}, I4, 1.0);
      },
      "layer_order[2] = 2: listed twice");
  expect_error<InvalidArgument>(
      [&] { floor_layers_within_budget(kLayout, plan, kShape, order, static_cast<Precision>(7), 1.0); }, "floor");
  expect_error<InvalidArgument>(
      [&] { floor_layers_within_budget(kLayout, PrecisionPlan(3, 5, I2), kShape, order, I4, 1.0); },
      "plan.num_layers()");
  expect_error<InvalidArgument>(
      [&] { floor_layers_within_budget(kLayout, PrecisionPlan(4, 4, I2), kShape, order, I4, 1.0); },
      "plan.num_windows()");
}

}  // namespace
}  // namespace mixkv
