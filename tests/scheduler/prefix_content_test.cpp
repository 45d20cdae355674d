// Prefix caching by content in the scheduler (PrefixIdentity::Content with
// PrefillMode::Exact): one video asked many questions, each with its own
// plan, prefills its visual rows once, and each request decodes over its
// own plan, asked one after another or all at once.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_test_util.h"

namespace mixkv {
namespace {

constexpr std::int32_t kVideoRows = 32 + 8 * 16;  // system text, 8 windows

CacheConfig content_cache(std::int32_t slabs) {
  CacheConfig c = test::tiny(slabs);
  c.prefix_cache.enabled = true;
  c.prefix_cache.identity = PrefixIdentity::Content;
  return c;
}

SchedulerConfig exact_config() {
  SchedulerConfig c = test::base_config();
  c.prefill_mode = PrefillMode::Exact;
  c.max_num_batched_tokens = 512;
  c.max_num_seqs = 16;
  return c;
}

// Question `q` on the video: its own rows and keys, and a plan drawn for it.
Request question(RequestId id, std::int32_t q, std::mt19937& rng) {
  const std::int32_t rows = 5 + q;
  Request r = test::request(id, {{TokenKind::Text, 32}, {TokenKind::Visual, 8 * 16}, {TokenKind::Text, rows}}, 6);
  std::uniform_int_distribution<int> pick(0, 9);
  for (std::int32_t w = 1; w < r.plan->num_windows(); ++w) {
    for (std::int32_t l = 0; l < 2; ++l) {
      const int d = pick(rng);
      r.plan->set(l, w, d == 0 ? Precision::FP16 : d < 4 ? Precision::INT4 : Precision::INT2);
    }
  }
  for (std::int32_t i = 0; i < kVideoRows; ++i) r.token_keys.push_back(1000 + i);
  for (std::int32_t i = 0; i < rows; ++i) r.token_keys.push_back(100000 * (q + 1) + i);
  return r;
}

bool same_plan(const PrecisionPlan& a, const PrecisionPlan& b) {
  if (a.num_layers() != b.num_layers() || a.num_windows() != b.num_windows()) return false;
  for (std::int32_t l = 0; l < a.num_layers(); ++l) {
    for (std::int32_t w = 0; w < a.num_windows(); ++w) {
      if (a.at(l, w) != b.at(l, w)) return false;
    }
  }
  return true;
}

// Steps until every request finished; requests [first, last) of `asked`
// must each decode, at their own plan from their first decode on.
void run(Scheduler& sched, KVCacheManager& cache, const std::vector<Request>& asked, std::size_t first,
         std::size_t last) {
  std::vector<bool> checked(asked.size(), false);
  for (int i = 0; i < 400 && sched.has_unfinished(); ++i) {
    const StepOutput out = sched.step();
    ASSERT_NO_THROW(sched.check_invariants());
    for (const RequestId id : out.decodes) {
      const auto k = static_cast<std::size_t>(id - 1);
      if (checked[k]) continue;
      EXPECT_FALSE(sched.status(id).plan_pending) << "request " << id;
      EXPECT_TRUE(same_plan(cache.plan(id), *asked[k].plan)) << "request " << id << " decodes at another plan";
      checked[k] = true;
    }
  }
  EXPECT_FALSE(sched.has_unfinished());
  for (std::size_t k = first; k < last; ++k) EXPECT_TRUE(checked[k]) << "request " << k + 1 << " never decoded";
}

TEST(PrefixContent, TenQuestionsPrefillTheVideoOnce) {
  for (const bool together : {false, true}) {
    SCOPED_TRACE(together ? "asked together" : "asked one after another");
    KVCacheManager cache(content_cache(60));
    Scheduler sched(cache, exact_config());
    std::mt19937 rng(7);
    std::vector<Request> asked;
    for (std::int32_t q = 0; q < 10; ++q) asked.push_back(question(q + 1, q, rng));
    std::int64_t question_rows = 0;
    for (const Request& r : asked) question_rows += r.layout.num_tokens() - kVideoRows;
    // The first question alone computes the video; the others follow.
    sched.add_request(asked[0]);
    run(sched, cache, asked, 0, 1);
    if (together) {
      for (std::size_t k = 1; k < asked.size(); ++k) sched.add_request(asked[k]);
      run(sched, cache, asked, 1, asked.size());
    } else {
      for (std::size_t k = 1; k < asked.size(); ++k) {
        sched.add_request(asked[k]);
        run(sched, cache, asked, k, k + 1);
      }
    }
    const SchedulerStats st = sched.stats();
    EXPECT_EQ(st.prefill_tokens, kVideoRows + question_rows);
    EXPECT_EQ(st.cached_prompt_tokens, 9 * kVideoRows);
    EXPECT_EQ(st.prefix_hits, 9);
    const PrefixCacheStats pc = cache.prefix_stats();
    EXPECT_GT(pc.cached[1] + pc.cached[2], 0) << "the plans' copies are cached beside the FP16 ones";
    cache.check_invariants();
  }
}

// PrefixHigher::Keep: a later question decodes at the FP16 copy it shares
// (its plan takes FP16 there) or at a quantized copy its plan names; no
// window it shares is demoted.
TEST(PrefixContent, KeepDecodesAtTheSharedCopies) {
  CacheConfig cc = content_cache(60);
  cc.prefix_cache.higher = PrefixHigher::Keep;
  KVCacheManager cache(cc);
  Scheduler sched(cache, exact_config());
  std::mt19937 rng(11);
  const std::vector<Request> asked{question(1, 0, rng), question(2, 1, rng)};
  sched.add_request(asked[0]);
  for (int i = 0; i < 100 && sched.has_unfinished(); ++i) sched.step();
  sched.add_request(asked[1]);
  const std::int64_t demotions_before = sched.stats().plan_demotions;
  int checked = 0;
  for (int i = 0; i < 100 && sched.has_unfinished(); ++i) {
    sched.step();
    ASSERT_NO_THROW(sched.check_invariants());
    if (!cache.contains(2) || sched.status(2).state != RequestState::Running) continue;
    ++checked;
    const PrecisionPlan& held = cache.plan(2);
    for (std::int32_t l = 0; l < 2; ++l) {
      for (std::int32_t w = 1; w < held.num_windows(); ++w) {
        const Precision want = asked[1].plan->at(l, w);
        const Precision first = asked[0].plan->at(l, w);
        // The cache holds FP16 and the first question's copy of each window.
        const Precision expect = want == first || want == Precision::FP16 ? want : Precision::FP16;
        EXPECT_EQ(held.at(l, w), expect) << "layer " << l << " window " << w;
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(sched.stats().plan_demotions, demotions_before) << "a question sharing every window demotes none";
  EXPECT_EQ(sched.stats().prefix_hits, 1);
}

TEST(PrefixContent, NeedsExactPrefill) {
  KVCacheManager cache(content_cache(8));
  SchedulerConfig c = test::base_config();
  c.prefill_mode = PrefillMode::Compact;
  try {
    Scheduler sched(cache, c);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("prefix_cache.identity"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mixkv
