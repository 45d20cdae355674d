// WindowPlanner end to end: rules, batches, statistics, and what the cache
// manager allocates for a plan.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/window_planner.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::F;
using test::I2;
using test::I4;

std::vector<Precision> row_of(const PrecisionPlan& plan, std::int32_t layer) {
  std::vector<Precision> row;
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) row.push_back(plan.at(layer, i));
  return row;
}

// hidden 2, window 16: text (1, 0) and (0, 2), whose normalized mean is
// (0.5, 0.5); four windows with similarities -0.5, 0.5, 0.3, -0.5; one
// visual tail token.
struct HandExample {
  TokenLayout layout{{{TokenKind::Text, 1}, {TokenKind::Visual, 4 * 16 + 1}, {TokenKind::Text, 1}}};
  test::Matrix m = test::make_matrix(ElementType::F32, 67, 2);

  HandExample() {
    const auto put = [&](std::int64_t row, float x, float y) {
      m.set(row, 0, x);
      m.set(row, 1, y);
    };
    put(0, 1, 0);
    put(66, 0, 2);
    for (int k = 0; k < 16; ++k) {
      const bool first_half = k < 8;
      put(1 + k, 0, -3);                                           // window 0: (0, -1)     -> -0.5
      put(17 + k, first_half ? 1 : 0, first_half ? 0 : 1);         // window 1: (0.5, 0.5)  -> 0.5
      put(33 + k, first_half ? 1 : -0.6f, first_half ? 0 : 0.8f);  // window 2: (0.2, 0.4) -> 0.3
      put(49 + k, first_half ? -1 : 0, first_half ? 0 : -1);       // window 3: (-0.5, -0.5) -> -0.5
    }
    put(65, 7, 7);  // the visual tail: FP16, not in the plan
  }
};

PlannerConfig hand_config() {
  PlannerConfig config;
  config.window_size = 16;
  config.alpha = 2.0;
  // alpha 2: s = 1 -> T = (1, 1); s = 0.5 -> T = (1/(e+1), e/(e+1)) = (0.269, 0.731);
  // s = 0 and s = -0.3 (clamped) -> T = (0, 0).
  config.sensitivities = {1.0, 0.5, 0.0, -0.3};
  config.min_precision = {I4, I2, I2, I2};
  return config;
}

TEST(WindowPlanner, HandComputedExampleEndToEnd) {
  const HandExample ex;
  const WindowPlanner planner(hand_config());
  ASSERT_EQ(planner.num_layers(), 4);
  EXPECT_EQ(planner.thresholds()[0], (LayerThresholds{1.0f, 1.0f}));
  EXPECT_NEAR(planner.thresholds()[1].low, 1.0 / (std::exp(1.0) + 1.0), 1e-7);
  EXPECT_NEAR(planner.thresholds()[1].high, std::exp(1.0) / (std::exp(1.0) + 1.0), 1e-7);
  EXPECT_EQ(planner.thresholds()[2], (LayerThresholds{0.0f, 0.0f}));
  EXPECT_EQ(planner.thresholds()[3], (LayerThresholds{0.0f, 0.0f}));

  const PrecisionPlan plan = planner.plan(ex.layout, ex.m.view());
  ASSERT_EQ(plan.num_layers(), 4);
  ASSERT_EQ(plan.num_windows(), 4);
  const float expected_scores[] = {-0.5f, 0.5f, 0.3f, -0.5f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(plan.score(i), expected_scores[i], 1e-7) << i;

  // Window 0 is FP16 everywhere despite its -0.5.
  // Layer 0 (s = 1): everything under T = 1 is INT2, raised to the layer's INT4.
  EXPECT_EQ(row_of(plan, 0), (std::vector<Precision>{F, I4, I4, I4}));
  // Layer 1 (s = 0.5): 0.5 and 0.3 inside [0.269, 0.731] -> INT4, -0.5 -> INT2.
  EXPECT_EQ(row_of(plan, 1), (std::vector<Precision>{F, I4, I4, I2}));
  // Layers 2, 3 (s <= 0): positive similarity FP16, negative INT2.
  EXPECT_EQ(row_of(plan, 2), (std::vector<Precision>{F, F, F, I2}));
  EXPECT_EQ(row_of(plan, 3), (std::vector<Precision>{F, F, F, I2}));

  // 67 tokens, 16 a block. Per layer the FP16 pool holds every token outside
  // a quantized window: layers 0, 1 keep 67 - 48 = 19 tokens (2 blocks),
  // layers 2, 3 keep 67 - 16 = 51 (4 blocks).
  const CacheShape shape{4, 1, 16, 16};
  const PlanStats stats = plan_stats(ex.layout, plan, shape);
  ASSERT_EQ(stats.layer_blocks.size(), 4u);
  EXPECT_EQ(stats.layer_blocks[0], (BlockCounts{2, 3, 0}));
  EXPECT_EQ(stats.layer_blocks[1], (BlockCounts{2, 2, 1}));
  EXPECT_EQ(stats.layer_blocks[2], (BlockCounts{4, 0, 1}));
  EXPECT_EQ(stats.layer_blocks[3], (BlockCounts{4, 0, 1}));
  EXPECT_EQ(stats.blocks, (BlockCounts{12, 5, 3}));
  // Blocks of one head, D = 16, S = 16: FP16 1024 bytes, INT4 384, INT2 256.
  EXPECT_EQ(BlockFormat(F, 1, 16, 16).block_bytes(), 1024u);
  EXPECT_EQ(BlockFormat(I4, 1, 16, 16).block_bytes(), 384u);
  EXPECT_EQ(BlockFormat(I2, 1, 16, 16).block_bytes(), 256u);
  EXPECT_EQ(stats.pool_bytes, (std::array<std::size_t, 3>{12 * 1024, 5 * 384, 3 * 256}));
  EXPECT_EQ(stats.bytes, 14976u);
  EXPECT_EQ(stats.fp16_bytes, 4u * 5u * 1024u);  // ceil(67 / 16) = 5 blocks a layer
  EXPECT_NEAR(stats.compression(), 20480.0 / 14976.0, 1e-12);

  // The manager allocates exactly that.
  KVCacheManager manager(CacheConfig{shape, 64 * 1024, 4096});
  EXPECT_EQ(manager.demand(ex.layout, plan), stats.blocks);
  manager.add_sequence(1, ex.layout, plan);
  for (const Precision p : kAllPrecisions) {
    EXPECT_EQ(manager.pool_stats(p).used_blocks, stats.blocks[pool_index(p)]) << to_string(p);
    for (std::int32_t l = 0; l < 4; ++l) {
      EXPECT_EQ(static_cast<std::int64_t>(manager.blocks(1, l, p).size()), stats.layer_blocks[l][pool_index(p)])
          << to_string(p) << " layer " << l;
    }
  }
  manager.check_invariants();
}

TEST(WindowPlanner, ScoresAreEquationEightAndRulesHoldOnRandomRequests) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> sensitivity(-0.2, 1.0);
  PlannerConfig config;
  config.window_size = 32;
  for (int l = 0; l < 28; ++l) config.sensitivities.push_back(sensitivity(rng));
  config.min_precision.assign(28, I2);
  config.min_precision[3] = I4;
  config.min_precision[27] = F;
  const WindowPlanner planner(config);

  // 3 frames of 196 tokens (the last window is partial), two text segments.
  const TokenLayout layout({{TokenKind::Text, 13}, {TokenKind::Visual, 3 * 196}, {TokenKind::Text, 64}});
  const test::Matrix m = test::random_embeddings(ElementType::F32, layout.num_tokens(), 64, 9);
  const PrecisionPlan plan = planner.plan(layout, m.view());
  ASSERT_EQ(plan.num_windows(), 18);  // 588 / 32, the 12-token tail stays FP16
  const std::vector<float> scores = window_similarity(layout, m.view(), 32);
  std::array<int, 3> seen{};
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) {
    EXPECT_EQ(plan.score(i), scores[i]);
    for (std::int32_t l = 0; l < 28; ++l) {
      const LayerThresholds t = layer_thresholds(config.sensitivities[l], config.alpha);
      EXPECT_EQ(planner.thresholds()[l], t);
      Precision expected = scores[i] > t.high ? F : (scores[i] < t.low ? I2 : I4);
      expected = max_precision(expected, config.min_precision[l]);
      if (i == 0) expected = F;
      EXPECT_EQ(plan.at(l, i), expected) << "layer " << l << " window " << i;
      ++seen[pool_index(plan.at(l, i))];
    }
  }
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) EXPECT_EQ(plan.at(27, i), F);
  for (std::int32_t i = 0; i < plan.num_windows(); ++i) EXPECT_NE(plan.at(3, i), I2);

  // Statistics against the manager, per layer and in total.
  const CacheShape shape{28, 4, 128, 32};
  const PlanStats stats = plan_stats(layout, plan, shape);
  KVCacheManager manager(CacheConfig{shape, std::size_t{64} << 20, 2u << 20});
  EXPECT_EQ(manager.demand(layout, plan), stats.blocks);
  manager.add_sequence(7, layout, plan);
  for (const Precision p : kAllPrecisions) {
    EXPECT_EQ(manager.pool_stats(p).used_blocks, stats.blocks[pool_index(p)]);
    for (std::int32_t l = 0; l < 28; ++l) {
      EXPECT_EQ(static_cast<std::int64_t>(manager.blocks(7, l, p).size()), stats.layer_blocks[l][pool_index(p)]);
    }
  }
  EXPECT_LT(stats.bytes, stats.fp16_bytes);
  manager.check_invariants();
}

TEST(WindowPlanner, RequestWithoutFullWindowsHasAnEmptyPlan) {
  PlannerConfig config;
  config.sensitivities = {0.5, 0.9};
  const WindowPlanner planner(config);
  const TokenLayout layout({{TokenKind::Text, 4}, {TokenKind::Visual, 31}});
  const test::Matrix m = test::random_embeddings(ElementType::BF16, layout.num_tokens(), 16, 2);
  const PrecisionPlan plan = planner.plan(layout, m.view());
  EXPECT_EQ(plan.num_layers(), 2);
  EXPECT_EQ(plan.num_windows(), 0);
  const PlanStats stats = plan_stats(layout, plan, CacheShape{2, 1, 16, 32});
  EXPECT_EQ(stats.blocks, (BlockCounts{4, 0, 0}));  // 35 tokens: 2 FP16 blocks a layer
  EXPECT_EQ(stats.bytes, stats.fp16_bytes);
  EXPECT_EQ(stats.compression(), 1.0);
}

PrecisionPlan plan_of(std::vector<std::vector<Precision>> rows, std::vector<float> scores) {
  PrecisionPlan plan(static_cast<std::int32_t>(rows.size()), static_cast<std::int32_t>(scores.size()));
  for (std::size_t l = 0; l < rows.size(); ++l) {
    for (std::size_t i = 0; i < scores.size(); ++i) plan.set(l, i, rows[l][i]);
  }
  for (std::size_t i = 0; i < scores.size(); ++i) plan.set_score(i, scores[i]);
  return plan;
}

TEST(WindowPlanner, LayerScoresDecideEachLayerByItsOwnRow) {
  const WindowPlanner planner(hand_config());
  // Thresholds (hand_config): layer 0 (1, 1) with INT4 as its minimum,
  // layer 1 (0.269, 0.731), layers 2 and 3 (0, 0).
  const std::vector<std::vector<float>> scores = {
      {0.0f, 0.5f, 0.9f, -0.5f}, {-0.4f, 0.8f, 0.5f, 0.1f}, {0.0f, 0.5f, -0.2f, -0.1f}, {-1.0f, -0.3f, 0.3f, 0.1f}};
  const PrecisionPlan plan = planner.plan_from_layer_scores(scores);
  EXPECT_EQ(plan,
            plan_of({{F, I4, I4, I4}, {F, F, I4, I2}, {F, F, I2, I2}, {F, I2, F, F}}, {-0.35f, 0.375f, 0.375f, -0.1f}));
  // One row repeated in every layer is plan_from_scores of that row.
  const std::vector<float> row = {0.2f, 0.9f, 0.5f, -0.7f};
  EXPECT_EQ(planner.plan_from_layer_scores(std::vector<std::vector<float>>(4, row)), planner.plan_from_scores(row));

  expect_error<InvalidArgument>([&] { planner.plan_from_layer_scores(std::vector<std::vector<float>>(3, row)); },
                                "scores.size() = 3, expected one row per layer (4)");
  std::vector<std::vector<float>> ragged(4, row);
  ragged[2].pop_back();
  expect_error<InvalidArgument>([&] { planner.plan_from_layer_scores(ragged); },
                                "scores[2].size() = 3, expected 4 as scores[0]");
  std::vector<std::vector<float>> infinite(4, row);
  infinite[3][1] = std::numeric_limits<float>::infinity();
  expect_error<InvalidArgument>([&] { planner.plan_from_layer_scores(infinite); }, "scores[3][1] = inf");
}

TEST(MajorityVote, MostFrequentChoicePerLayerAndWindowTiesGoUp) {
  std::vector<PrecisionPlan> plans = {
      plan_of({{F, I2, I4, I4}, {F, I4, I2, I2}}, {0.1f, 0.2f, 0.3f, 0.4f}),
      plan_of({{F, I2, I2, I2}, {F, I4, I2, I4}}, {0.5f, 0.6f, 0.7f, 0.8f}),
      plan_of({{F, I4, F, I2}, {F, I2, F, F}}, {0.9f, 1.0f, -0.1f, -0.2f}),
      // Fewer windows: votes only where it has a window.
      plan_of({{F, I2}, {F, I2}}, {0.0f, 0.0f}),
  };
  const std::vector<PrecisionPlan> before = plans;
  majority_vote(plans);
  // Layer 0: window 1 INT2 3:1; window 2 INT4/INT2/FP16 1:1:1 -> FP16;
  // window 3 INT2 2:1. Layer 1: window 1 INT4/INT2 2:2 -> INT4; window 2
  // INT2 2:1; window 3 one vote each -> FP16.
  const std::vector<Precision> layer0 = {F, I2, F, I2};
  const std::vector<Precision> layer1 = {F, I4, I2, F};
  for (std::size_t r = 0; r < plans.size(); ++r) {
    const auto n = static_cast<std::size_t>(plans[r].num_windows());
    EXPECT_EQ(row_of(plans[r], 0), std::vector<Precision>(layer0.begin(), layer0.begin() + n)) << r;
    EXPECT_EQ(row_of(plans[r], 1), std::vector<Precision>(layer1.begin(), layer1.begin() + n)) << r;
    for (std::int32_t i = 0; i < plans[r].num_windows(); ++i) EXPECT_EQ(plans[r].score(i), before[r].score(i));
  }

  // A two-way tie between the quantized choices goes to INT4.
  std::vector<PrecisionPlan> pair = {plan_of({{I4}}, {0.0f}), plan_of({{I2}}, {0.0f})};
  majority_vote(pair);
  EXPECT_EQ(pair[0].at(0, 0), I4);
  EXPECT_EQ(pair[1].at(0, 0), I4);

  std::vector<PrecisionPlan> none;
  EXPECT_NO_THROW(majority_vote(none));
}

TEST(MajorityVote, RejectsPlansOfDifferentDepthAndChangesNothing) {
  std::vector<PrecisionPlan> plans = {plan_of({{F, I2}}, {0.1f, 0.2f}), plan_of({{F, I4}}, {0.1f, 0.2f}),
                                      plan_of({{F, I4}, {F, I4}}, {0.1f, 0.2f})};
  const std::vector<PrecisionPlan> before = plans;
  expect_error<InvalidArgument>([&] { majority_vote(plans); }, "plans[2].num_layers() = 2, expected 1");
  EXPECT_EQ(plans, before);
}

TEST(WindowPlanner, BatchPolicies) {
  PlannerConfig config;
  config.window_size = 16;
  config.sensitivities = {0.95, 0.6, 0.3, 0.05};
  const std::vector<TokenLayout> layouts = {
      TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 8 * 16}, {TokenKind::Text, 5}}),
      TokenLayout({{TokenKind::Text, 9}, {TokenKind::Visual, 8 * 16 + 4}}),
      TokenLayout({{TokenKind::Visual, 5 * 16}, {TokenKind::Text, 2}}),
  };
  std::vector<test::Matrix> matrices;
  std::vector<EmbeddingsView> views;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    matrices.push_back(test::random_embeddings(ElementType::F16, layouts[r].num_tokens(), 32, 40 + r));
  }
  for (const auto& m : matrices) views.push_back(m.view());

  const std::vector<PrecisionPlan> own = WindowPlanner(config).plan(layouts, views);
  ASSERT_EQ(own.size(), 3u);
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(own[r], WindowPlanner(config).plan(layouts[r], views[r]));

  config.batch_policy = BatchPolicy::MajorityVote;
  const std::vector<PrecisionPlan> voted = WindowPlanner(config).plan(layouts, views);
  std::vector<PrecisionPlan> expected = own;
  majority_vote(expected);
  EXPECT_EQ(voted, expected);
  for (std::int32_t l = 0; l < 4; ++l) {
    for (std::int32_t i = 0; i < 5; ++i) {
      EXPECT_EQ(voted[0].at(l, i), voted[2].at(l, i));
      EXPECT_EQ(voted[1].at(l, i), voted[2].at(l, i));
    }
  }
}

TEST(WindowPlanner, RejectsBadConfiguration) {
  const auto make = [](auto edit) {
    PlannerConfig config;
    config.sensitivities = {0.5, 0.7};
    edit(config);
    return [config] { WindowPlanner{config}; };
  };
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.window_size = 0; }), "window_size = 0");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.alpha = 0.0; }), "alpha = 0");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.alpha = -2.0; }), "alpha = -2");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.alpha = std::numeric_limits<double>::infinity(); }),
                                "alpha = inf");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.alpha = std::nan(""); }), "alpha = nan");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.sensitivities.clear(); }), "sensitivities is empty");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.sensitivities[1] = 1.5; }), "sensitivities[1] = 1.5");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.sensitivities[0] = -1.01; }), "sensitivities[0] = -1.01");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.sensitivities[1] = std::nan(""); }),
                                "sensitivities[1] = nan");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.min_precision = {I4}; }),
                                "min_precision holds 1 layers, expected 0 or 2");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) {
                                  c.min_precision = {I4, static_cast<Precision>(3)};
                                }),
                                "min_precision[1] = 3");
  expect_error<InvalidArgument>(make([](PlannerConfig& c) { c.batch_policy = static_cast<BatchPolicy>(2); }),
                                "batch_policy = 2");
  // The extremes of the range are fine.
  EXPECT_NO_THROW(make([](PlannerConfig& c) { c.sensitivities = {-1.0, 1.0}; })());
}

TEST(WindowPlanner, RejectsBadRequests) {
  PlannerConfig config;
  config.window_size = 4;
  config.sensitivities = {0.5};
  const WindowPlanner planner(config);
  const TokenLayout layout({{TokenKind::Text, 2}, {TokenKind::Visual, 8}});
  test::Matrix m = test::random_embeddings(ElementType::F32, layout.num_tokens(), 8, 3);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float scores[] = {0.1f, nan};
  expect_error<InvalidArgument>([&] { planner.plan_from_scores(scores); }, "scores[1] = nan");
  expect_error<InvalidArgument>(
      [&] {
        planner.plan(TokenLayout({{TokenKind::Visual, 10}}), m.view());
      },
      "layout has no text tokens");
  EmbeddingsView wrong = m.view();
  wrong.num_tokens = 11;
  expect_error<InvalidArgument>([&] { planner.plan(layout, wrong); }, "embeddings.num_tokens = 11, expected 10");
  m.set(9, 2, std::numeric_limits<float>::infinity());
  expect_error<InvalidArgument>([&] { planner.plan(layout, m.view()); }, "row 9 (visual window 1)");

  const PrecisionPlan plan(1, 2);
  expect_error<InvalidArgument>(
      [&] {
        plan_stats(layout, plan, CacheShape{2, 1, 16, 16});
      },
      "plan.num_layers() = 1, expected 2");
  const TokenLayout long_layout({{TokenKind::Text, 2}, {TokenKind::Visual, 48}});
  expect_error<InvalidArgument>(
      [&] {
        plan_stats(long_layout, plan, CacheShape{1, 1, 16, 16});
      },
      "plan.num_windows() = 2, expected 3");
  expect_error<InvalidArgument>([&] { plan_stats(long_layout, plan, CacheShape{1, 1, 16, 8}); }, "block_size");
}

}  // namespace
}  // namespace mixkv
