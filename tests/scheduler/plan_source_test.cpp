// The scheduler takes the plans of requests that come with embeddings from
// a PlanSource: an injected source is used (a test double records every
// call), its config is checked against the cache like config.planner's,
// its floors bind demotion, and its errors leave the scheduler unchanged.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../planner/planner_test_util.h"
#include "mixkv/core/errors.h"
#include "mixkv/planner/plan_source.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

using test::base_config;
using test::request;
using test::tiny;

// Plans every request with plan_for(layout, fill), records what it was
// given, and throws what it is told to.
class FakePlanSource : public PlanSource {
 public:
  enum class Fail { None, InvalidArgument, Runtime, NoPlan, WrongShape };

  explicit FakePlanSource(PlannerConfig config) : config_(std::move(config)) {}

  const PlannerConfig& config() const override { return config_; }

  std::vector<PrecisionPlan> plan(std::span<const TokenLayout> layouts,
                                  std::span<const EmbeddingsView> embeddings) override {
    ++calls;
    layouts_seen.insert(layouts_seen.end(), layouts.begin(), layouts.end());
    for (const EmbeddingsView& e : embeddings) data_seen.push_back(e.data);
    switch (fail) {
      case Fail::InvalidArgument: throw InvalidArgument("embeddings[0]: a NaN in row 3");
      case Fail::Runtime: throw std::runtime_error("the device went away");
      case Fail::NoPlan: return {};
      case Fail::WrongShape: return {PrecisionPlan(5, 1)};
      case Fail::None: break;
    }
    std::vector<PrecisionPlan> plans;
    for (const TokenLayout& layout : layouts) plans.push_back(test::plan_for(layout, fill));
    return plans;
  }

  Fail fail = Fail::None;
  Precision fill = Precision::INT4;
  int calls = 0;
  std::vector<TokenLayout> layouts_seen;
  std::vector<const void*> data_seen;

 private:
  PlannerConfig config_;
};

PlannerConfig planner_config() {
  PlannerConfig c;
  c.window_size = 16;
  c.sensitivities = {0.5, 0.5};
  return c;
}

// A request with embeddings instead of a plan (the fake never reads them).
Request with_embeddings(RequestId id, const std::vector<float>& rows, std::int32_t max_new = 3) {
  Request r;
  r.id = id;
  r.layout = TokenLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 32}, {TokenKind::Text, 4}});
  r.embeddings = EmbeddingsView{rows.data(), ElementType::F32, r.layout.num_tokens(), 4};
  r.max_new_tokens = max_new;
  r.arrival_time = static_cast<double>(id);
  return r;
}

TEST(PlanSource, InjectedSourcePlansRequestsWithEmbeddings) {
  KVCacheManager cache(tiny(40));
  auto source = std::make_shared<FakePlanSource>(planner_config());
  Scheduler sched(cache, base_config(), source);
  EXPECT_EQ(sched.planner(), source);
  const std::vector<float> rows(40 * 4, 1.0f);
  sched.add_request(with_embeddings(1, rows));
  ASSERT_EQ(source->calls, 1);
  EXPECT_EQ(source->layouts_seen.at(0).num_tokens(), 40);
  EXPECT_EQ(source->data_seen.at(0), rows.data());
  // A request that brings its plan is not planned again.
  sched.add_request(request(2, {{TokenKind::Text, 4}}, 3));
  EXPECT_EQ(source->calls, 1);
  (void)sched.step();
  // The plan in the cache is the source's: window 1 INT4 in both layers.
  ASSERT_TRUE(cache.contains(1));
  EXPECT_EQ(cache.plan(1).at(0, 1), Precision::INT4);
  EXPECT_EQ(cache.plan(1).at(1, 1), Precision::INT4);
  EXPECT_EQ(cache.plan(1).at(0, 0), Precision::FP16);
}

TEST(PlanSource, ConfigPlannerStillBuildsTheCpuSource) {
  KVCacheManager cache(tiny(40));
  SchedulerConfig config = base_config();
  config.planner = planner_config();
  Scheduler sched(cache, config);
  ASSERT_NE(sched.planner(), nullptr);
  EXPECT_EQ(sched.planner()->config().window_size, 16);
  // The same plan as the CPU planner gives directly.
  const test::Matrix m = test::random_embeddings(ElementType::F32, 40, 8, 11);
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 32}, {TokenKind::Text, 4}});
  r.embeddings = m.view();
  r.max_new_tokens = 2;
  sched.add_request(r);
  (void)sched.step();
  const PrecisionPlan expected = WindowPlanner(planner_config()).plan(r.layout, m.view());
  for (std::int32_t w = 0; w < expected.num_windows(); ++w) {
    EXPECT_EQ(cache.plan(1).score(w), expected.score(w));
    for (std::int32_t l = 0; l < 2; ++l) EXPECT_EQ(cache.plan(1).at(l, w), expected.at(l, w));
  }
}

TEST(PlanSource, ErrorsFromTheSourceLeaveTheSchedulerUnchanged) {
  KVCacheManager cache(tiny(40));
  auto source = std::make_shared<FakePlanSource>(planner_config());
  Scheduler sched(cache, base_config(), source);
  sched.add_request(request(1, {{TokenKind::Text, 4}}, 3));
  const std::vector<float> rows(40 * 4, 1.0f);
  const std::string before = sched.describe_state();
  const SchedulerStats stats = sched.stats();
  auto unchanged = [&] {
    EXPECT_EQ(sched.describe_state(), before);
    EXPECT_FALSE(sched.contains(2));
    EXPECT_EQ(sched.stats().waiting, stats.waiting);
    EXPECT_NO_THROW(sched.check_invariants());
  };
  source->fail = FakePlanSource::Fail::InvalidArgument;
  test::expect_error<InvalidArgument>([&] { sched.add_request(with_embeddings(2, rows)); }, "a NaN in row 3");
  unchanged();
  source->fail = FakePlanSource::Fail::Runtime;
  EXPECT_THROW(sched.add_request(with_embeddings(2, rows)), std::runtime_error);
  unchanged();
  source->fail = FakePlanSource::Fail::NoPlan;
  test::expect_error<InvalidArgument>([&] { sched.add_request(with_embeddings(2, rows)); },
                                      "the planner returned 0 plans for one request, expected 1");
  unchanged();
  source->fail = FakePlanSource::Fail::WrongShape;
  test::expect_error<InvalidArgument>([&] { sched.add_request(with_embeddings(2, rows)); }, "the planner's plan");
  unchanged();
  EXPECT_EQ(source->calls, 4);
  // The id was never taken: the same request goes in once the source works.
  source->fail = FakePlanSource::Fail::None;
  sched.add_request(with_embeddings(2, rows));
  EXPECT_TRUE(sched.contains(2));
}

TEST(PlanSource, ConfigAndSourceAreCheckedAgainstTheCache) {
  KVCacheManager cache(tiny(8));
  auto refused = [&](SchedulerConfig config, PlannerConfig source_config, const std::string& needle) {
    test::expect_error<InvalidArgument>(
        [&] { Scheduler s(cache, config, std::make_shared<FakePlanSource>(std::move(source_config))); }, needle);
  };
  SchedulerConfig with_planner = base_config();
  with_planner.planner = planner_config();
  refused(with_planner, planner_config(), "config.planner and planner are both given");
  PlannerConfig c = planner_config();
  c.window_size = 32;
  refused(base_config(), c, "planner.config().window_size = 32, expected the cache's block_size 16");
  c = planner_config();
  c.sensitivities = {0.5, 0.5, 0.5};
  refused(base_config(), c, "planner.config().sensitivities has 3 layers, expected 2");
  c = planner_config();
  c.min_precision = {Precision::INT4};
  refused(base_config(), c, "planner.config().min_precision has 1 layers, expected 0 or 2");
  c.min_precision = {Precision::INT4, static_cast<Precision>(7)};
  refused(base_config(), c, "planner.config().min_precision[1] = 7");
  // config.planner keeps its own names.
  with_planner.planner->sensitivities = {0.5};
  test::expect_error<InvalidArgument>([&] { Scheduler s(cache, with_planner); },
                                      "config.planner.sensitivities has 1 layers, expected 2");
  EXPECT_TRUE(cache.sequence_ids().empty());
}

}  // namespace
}  // namespace mixkv
