// make_cpu_plan_source: the CPU WindowPlanner behind the PlanSource
// interface the scheduler takes plans through. Same config, same plans
// (both batch policies), same errors.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/planner/plan_source.h"
#include "planner_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

PlannerConfig config_of(BatchPolicy policy) {
  PlannerConfig config;
  config.window_size = 16;
  config.alpha = 1.5;
  config.sensitivities = {0.95, 0.6, 0.3, 0.05};
  config.min_precision = {test::F, test::I4, test::I2, test::I2};
  config.batch_policy = policy;
  return config;
}

TEST(CpuPlanSource, GivesTheWindowPlannersPlansUnderEitherBatchPolicy) {
  const std::vector<TokenLayout> layouts = {
      TokenLayout({{TokenKind::Text, 3}, {TokenKind::Visual, 8 * 16}, {TokenKind::Text, 5}}),
      TokenLayout({{TokenKind::Text, 9}, {TokenKind::Visual, 8 * 16 + 4}}),
      TokenLayout({{TokenKind::Visual, 5 * 16}, {TokenKind::Text, 2}}),
  };
  std::vector<test::Matrix> matrices;
  std::vector<EmbeddingsView> views;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    matrices.push_back(test::random_embeddings(ElementType::BF16, layouts[r].num_tokens(), 24, 70 + r));
  }
  for (const auto& m : matrices) views.push_back(m.view());
  for (const BatchPolicy policy : {BatchPolicy::PerRequest, BatchPolicy::MajorityVote}) {
    const PlannerConfig config = config_of(policy);
    const std::shared_ptr<PlanSource> source = make_cpu_plan_source(config);
    ASSERT_NE(source, nullptr);
    EXPECT_EQ(source->config().window_size, config.window_size);
    EXPECT_EQ(source->config().alpha, config.alpha);
    EXPECT_EQ(source->config().sensitivities, config.sensitivities);
    EXPECT_EQ(source->config().min_precision, config.min_precision);
    EXPECT_EQ(source->config().batch_policy, policy);
    EXPECT_EQ(source->plan(layouts, views), WindowPlanner(config).plan(layouts, views));
    // One request at a time, as the scheduler asks.
    const std::vector<PrecisionPlan> one = source->plan({&layouts[1], 1}, {&views[1], 1});
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(one[0], WindowPlanner(config).plan(layouts[1], views[1]));
  }
}

TEST(CpuPlanSource, RefusesWhatTheWindowPlannerRefuses) {
  PlannerConfig config = config_of(BatchPolicy::PerRequest);
  config.alpha = 0.0;
  expect_error<InvalidArgument>([&] { (void)make_cpu_plan_source(config); }, "alpha = 0");
  config = config_of(BatchPolicy::PerRequest);
  config.min_precision = {test::I4};
  expect_error<InvalidArgument>([&] { (void)make_cpu_plan_source(config); },
                                "min_precision holds 1 layers, expected 0 or 4");

  const std::shared_ptr<PlanSource> source = make_cpu_plan_source(config_of(BatchPolicy::PerRequest));
  const TokenLayout layout({{TokenKind::Text, 4}, {TokenKind::Visual, 32}});
  const test::Matrix short_rows = test::random_embeddings(ElementType::F32, 30, 8, 5);
  const EmbeddingsView view = short_rows.view();
  expect_error<InvalidArgument>([&] { (void)source->plan({&layout, 1}, {&view, 1}); }, "embeddings");
  // A NaN in a row eq. 8 reads is refused naming the request; the source
  // keeps serving afterwards.
  test::Matrix rows = test::random_embeddings(ElementType::F32, 36, 8, 6);
  rows.set(10, 2, std::nanf(""));
  const EmbeddingsView bad = rows.view();
  expect_error<InvalidArgument>([&] { (void)source->plan({&layout, 1}, {&bad, 1}); }, "NaN");
  rows.set(10, 2, 0.5f);
  const EmbeddingsView good = rows.view();
  EXPECT_EQ(source->plan({&layout, 1}, {&good, 1}).size(), 1u);
}

}  // namespace
}  // namespace mixkv
