// plan_from_layer_scores_within_budget: a plan from per-(layer, window)
// scores (the question's attention mass) at a KV byte budget.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/score_budget.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::F;
using test::I2;
using test::I4;

// 4 text tokens, 4 windows of 16, 3 text tokens; 2 layers, 1 KV head of 16
// channels: blocks of 1,024 (FP16), 384 (INT4) and 256 (INT2) bytes, so an
// INT2 -> INT4 step costs 128 bytes and an INT4 -> FP16 step 640.
const TokenLayout kLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 64}, {TokenKind::Text, 3}});
const CacheShape kShape{2, 1, 16, 16};
constexpr std::size_t kToInt4 = 128;
constexpr std::size_t kToFp16 = 640;

// With the default errors (0.1, 0.5) an INT4 step gains 0.4 s / 128 per byte
// and a FP16 step 0.1 s / 640: a window's FP16 step outranks another's INT4
// step only when its score is 20 times larger.
const std::vector<std::vector<float>> kScores = {{7.0f, 1.0f, 0.0f, 5.0f}, {7.0f, 2.0f, 8.0f, 0.5f}};

std::size_t start_bytes() {
  PrecisionPlan plan(2, 4, I2);
  plan.set(0, 0, F);
  plan.set(1, 0, F);
  return plan_stats(kLayout, plan, kShape).bytes;
}

double ratio_for(std::size_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(plan_stats(kLayout, PrecisionPlan(2, 4, F), kShape).bytes);
}

PrecisionPlan table(const std::vector<std::vector<Precision>>& rows) {
  PrecisionPlan plan(2, 4, I2);
  for (std::int32_t l = 0; l < 2; ++l) {
    for (std::int32_t w = 0; w < 4; ++w) plan.set(l, w, rows[l][w]);
  }
  return plan;
}

std::vector<std::vector<Precision>> precisions(const PrecisionPlan& plan) {
  std::vector<std::vector<Precision>> rows(static_cast<std::size_t>(plan.num_layers()));
  for (std::int32_t l = 0; l < plan.num_layers(); ++l) {
    for (std::int32_t w = 0; w < plan.num_windows(); ++w) rows[l].push_back(plan.at(l, w));
  }
  return rows;
}

TEST(ScoreBudget, StepCostsAreTheBlockFormatsDifferences) {
  const auto bytes = [](Precision p) { return BlockFormat{p, 1, 16, 16}.block_bytes(); };
  EXPECT_EQ(bytes(I4) - bytes(I2), kToInt4);
  EXPECT_EQ(bytes(F) - bytes(I4), kToFp16);
}

TEST(ScoreBudget, TakesInt4StepsInScoreOrder) {
  // Room for three INT4 steps: scores 8 (1, 2), 5 (0, 3), 2 (1, 1).
  const ScoredBudgetPlan fitted =
      plan_from_layer_scores_within_budget(kLayout, kScores, kShape, ratio_for(start_bytes() + 3 * kToInt4));
  EXPECT_EQ(precisions(fitted.plan), precisions(table({{F, I2, I2, I4}, {F, I4, I4, I2}})));
  EXPECT_EQ(fitted.stats.bytes, start_bytes() + 3 * kToInt4);
}

TEST(ScoreBudget, FpSixteenStepRanksByGainPerByte) {
  // The five INT4 steps of nonzero score (8, 5, 2, 1, 0.5), then (1, 2)'s FP16
  // step (8 / 20 = 0.4 in INT4 units), then the INT4 step of score 0.
  const std::size_t five = start_bytes() + 5 * kToInt4;
  const ScoredBudgetPlan fp16 =
      plan_from_layer_scores_within_budget(kLayout, kScores, kShape, ratio_for(five + kToFp16));
  EXPECT_EQ(precisions(fp16.plan), precisions(table({{F, I4, I2, I4}, {F, I4, F, I4}})));
  const ScoredBudgetPlan all =
      plan_from_layer_scores_within_budget(kLayout, kScores, kShape, ratio_for(five + kToFp16 + kToInt4));
  EXPECT_EQ(precisions(all.plan), precisions(table({{F, I4, I4, I4}, {F, I4, F, I4}})));
}

TEST(ScoreBudget, AStepThatDoesNotFitLeavesRoomForCheaperOnes) {
  // 600 bytes after the five INT4 steps: the FP16 step (640) is dropped, the
  // score-0 INT4 step (128) still fits.
  const ScoredBudgetPlan fitted =
      plan_from_layer_scores_within_budget(kLayout, kScores, kShape, ratio_for(start_bytes() + 5 * kToInt4 + 600));
  EXPECT_EQ(precisions(fitted.plan), precisions(table({{F, I4, I4, I4}, {F, I4, I4, I4}})));
  EXPECT_EQ(fitted.stats.bytes, start_bytes() + 6 * kToInt4);
}

TEST(ScoreBudget, EqualGainsGoToTheLowerLayerThenWindow) {
  const std::vector<std::vector<float>> flat(2, std::vector<float>(4, 1.0f));
  const ScoredBudgetPlan fitted =
      plan_from_layer_scores_within_budget(kLayout, flat, kShape, ratio_for(start_bytes() + 4 * kToInt4));
  EXPECT_EQ(precisions(fitted.plan), precisions(table({{F, I4, I4, I4}, {F, I4, I2, I2}})));
}

TEST(ScoreBudget, FirstWindowIsFp16UnlessConfiguredOtherwise) {
  const std::vector<std::vector<float>> zero_first = {{0.0f, 1.0f, 1.0f, 1.0f}, {0.0f, 1.0f, 1.0f, 1.0f}};
  const ScoredBudgetPlan pinned = plan_from_layer_scores_within_budget(kLayout, zero_first, kShape, 0.01);
  EXPECT_EQ(precisions(pinned.plan), precisions(table({{F, I2, I2, I2}, {F, I2, I2, I2}})));
  ScoreBudgetConfig config;
  config.first_window_fp16 = false;
  const ScoredBudgetPlan free = plan_from_layer_scores_within_budget(kLayout, zero_first, kShape, 0.01, config);
  EXPECT_EQ(precisions(free.plan), precisions(table({{I2, I2, I2, I2}, {I2, I2, I2, I2}})));
  EXPECT_LT(free.stats.bytes, pinned.stats.bytes);
}

TEST(ScoreBudget, OverBudgetStartComesBackUnchanged) {
  const ScoredBudgetPlan fitted = plan_from_layer_scores_within_budget(kLayout, kScores, kShape, 1e-3);
  EXPECT_EQ(precisions(fitted.plan), precisions(table({{F, I2, I2, I2}, {F, I2, I2, I2}})));
  EXPECT_EQ(fitted.stats.bytes, start_bytes());
}

TEST(ScoreBudget, FullBudgetIsAllFp16) {
  const ScoredBudgetPlan fitted = plan_from_layer_scores_within_budget(kLayout, kScores, kShape, 1.0);
  EXPECT_EQ(fitted.plan.window_counts(0)[pool_index(F)], 4);
  EXPECT_EQ(fitted.plan.window_counts(1)[pool_index(F)], 4);
  EXPECT_EQ(fitted.stats.bytes, fitted.stats.fp16_bytes);
}

TEST(ScoreBudget, PlanScoreIsTheMeanOverLayers) {
  const ScoredBudgetPlan fitted = plan_from_layer_scores_within_budget(kLayout, kScores, kShape, 0.3);
  EXPECT_FLOAT_EQ(fitted.plan.score(0), 7.0f);
  EXPECT_FLOAT_EQ(fitted.plan.score(1), 1.5f);
  EXPECT_FLOAT_EQ(fitted.plan.score(2), 4.0f);
  EXPECT_FLOAT_EQ(fitted.plan.score(3), 2.75f);
}

TEST(ScoreBudget, RandomScoresStayWithinBudgetAndLeaveNoStepThatFits) {
  // 3 layers, 2 KV heads of 64 channels, windows of 32; text, 17 windows and a tail.
  const TokenLayout layout({{TokenKind::Text, 9}, {TokenKind::Visual, 17 * 32 + 5}, {TokenKind::Text, 11}});
  const CacheShape shape{3, 2, 64, 32};
  const auto bytes = [&](Precision p) { return BlockFormat{p, 2, 64, 32}.block_bytes(); };
  std::mt19937 rng(7);
  std::exponential_distribution<float> mass(1.0f);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<std::vector<float>> scores(3, std::vector<float>(17));
    for (auto& row : scores) {
      for (float& s : row) s = mass(rng) * mass(rng);
    }
    const double budget = 0.3 + 0.0175 * trial;  // from just above the all-INT2 start to all FP16
    const ScoredBudgetPlan fitted = plan_from_layer_scores_within_budget(layout, scores, shape, budget);
    const PlanStats stats = plan_stats(layout, fitted.plan, shape);
    ASSERT_EQ(fitted.stats.bytes, stats.bytes);
    ASSERT_EQ(fitted.stats.blocks, stats.blocks);
    ASSERT_LE(static_cast<double>(stats.bytes), budget * static_cast<double>(stats.fp16_bytes)) << "trial " << trial;
    const double left = budget * static_cast<double>(stats.fp16_bytes) - static_cast<double>(stats.bytes);
    bool any_int2 = false;
    bool any_int4 = false;
    for (std::int32_t l = 0; l < 3; ++l) {
      ASSERT_EQ(fitted.plan.at(l, 0), F);
      for (std::int32_t w = 1; w < 17; ++w) {
        any_int2 |= fitted.plan.at(l, w) == I2;
        any_int4 |= fitted.plan.at(l, w) == I4;
        // Within a layer a window of higher score is never stored below one of lower score at INT4 level.
        for (std::int32_t v = 1; v < 17; ++v) {
          if (scores[l][w] > scores[l][v] && fitted.plan.at(l, v) != I2) {
            ASSERT_NE(fitted.plan.at(l, w), I2) << "trial " << trial << " layer " << l;
          }
        }
      }
    }
    if (any_int2) {
      EXPECT_LT(left, static_cast<double>(bytes(I4) - bytes(I2))) << "trial " << trial;
    }
    if (any_int4) {
      EXPECT_LT(left, static_cast<double>(bytes(F) - bytes(I4))) << "trial " << trial;
    }
  }
}

TEST(ScoreBudget, BadArgumentsNameTheArgumentAndChangeNothing) {
  const auto call = [](const std::vector<std::vector<float>>& scores, double budget, ScoreBudgetConfig config = {},
                       CacheShape shape = kShape) {
    return [=] { plan_from_layer_scores_within_budget(kLayout, scores, shape, budget, config); };
  };
  expect_error<InvalidArgument>(call(kScores, 0.0), "budget_ratio = 0");
  expect_error<InvalidArgument>(call(kScores, std::numeric_limits<double>::quiet_NaN()), "budget_ratio");
  expect_error<InvalidArgument>(call({kScores[0]}, 0.3), "scores: 1 rows, expected one per layer (2");
  expect_error<InvalidArgument>(call({kScores[0], {1.0f, 2.0f, 3.0f}}, 0.3),
                                "scores[1]: 3 scores, expected one per window (4");
  auto bad = kScores;
  bad[1][2] = std::numeric_limits<float>::quiet_NaN();
  expect_error<InvalidArgument>(call(bad, 0.3), "scores[1][2] = nan");
  bad[1][2] = -0.5f;
  expect_error<InvalidArgument>(call(bad, 0.3), "scores[1][2] = -0.5");
  bad[1][2] = std::numeric_limits<float>::infinity();
  expect_error<InvalidArgument>(call(bad, 0.3), "scores[1][2] = inf");
  ScoreBudgetConfig config;
  config.int4_error = -0.1;
  expect_error<InvalidArgument>(call(kScores, 0.3, config), "config.int4_error");
  config = {};
  config.int2_error = 0.05;
  expect_error<InvalidArgument>(call(kScores, 0.3, config), "config.int2_error = 0.05");
  config = {};
  config.int2_error = std::numeric_limits<double>::infinity();
  expect_error<InvalidArgument>(call(kScores, 0.3, config), "config.int2_error");
  expect_error<InvalidArgument>(call(kScores, 0.3, {}, CacheShape{2, 1, 16, 0}), "block_size");
  // The caller's scores are untouched by a failed call.
  EXPECT_EQ(bad[0], kScores[0]);
}

}  // namespace
}  // namespace mixkv
