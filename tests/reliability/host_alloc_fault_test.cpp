// Fault injection: host memory allocation failing inside a public call
// (docs/reliability.md). This executable replaces the global operator new
// with one that can be told to throw std::bad_alloc at the n-th allocation
// from now. Each call below is run with n = 0, 1, 2, ... until it gets
// through: every failed attempt must propagate std::bad_alloc and leave the
// bookkeeping exactly as it was (describe_state, check_invariants), the
// guarantee every other error of the API gives. A failure here names the
// call and the allocation at which the guarantee broke.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <ostream>
#include <string>
#include <vector>

#include "../cache/cache_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace {

// -1: off; n >= 0: the n-th allocation from now throws (then off again).
long g_countdown = -1;
long g_injected = 0;

}  // namespace

// The replacements below pair malloc with free themselves; GCC cannot see
// that through the inlined new-expressions and warns at every delete.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

void* operator new(std::size_t bytes) {
  if (g_countdown >= 0 && g_countdown-- == 0) {
    ++g_injected;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// Every other unaligned form goes to malloc/free too, so that no block
// allocated by the runtime's operator is freed by ours (AddressSanitizer
// reports the mismatch). The nothrow and array forms inject no failure:
// the library under test uses neither, GoogleTest uses nothrow new.
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept { return std::malloc(bytes == 0 ? 1 : bytes); }
void* operator new[](std::size_t bytes) {
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept { return std::malloc(bytes == 0 ? 1 : bytes); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace mixkv {
namespace {

using test::kTinyBlock;
using test::tiny_config;

struct Stats {
  long attempts = 0;
  long allocation_points = 0;
};

// Runs `call` failing at allocation 0, 1, 2, ... until it returns. Returns
// how many allocations it makes when nothing fails.
long fail_each_allocation(const KVCacheManager& cache, const std::string& name, const std::function<void()>& call) {
  for (long n = 0; n < 100000; ++n) {
    const std::string before = cache.describe_state();
    g_countdown = n;
    bool threw = false;
    try {
      call();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    g_countdown = -1;
    if (!threw) return n;
    // (Both texts are long: only the verdict is printed.)
    EXPECT_TRUE(cache.describe_state() == before) << name << ": the state changed when allocation " << n << " failed";
    try {
      cache.check_invariants();
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": allocation " << n << " failed, then: " << e.what();
    }
    if (testing::Test::HasFailure()) return n;  // the first broken point is the useful one
  }
  ADD_FAILURE() << name << " never got through";
  return -1;
}

// A state with every kind of sequence: mixed plans, a fork sharing a partly
// filled tail, one swapped out.
void populate(KVCacheManager& cache) {
  const TokenLayout layout({{TokenKind::Text, 5}, {TokenKind::Visual, 3 * kTinyBlock + 4}});
  PrecisionPlan plan(2, 3);
  plan.set(0, 1, Precision::INT4);
  plan.set(1, 2, Precision::INT2);
  cache.add_sequence(0, layout, plan);
  cache.add_sequence(1, test::text(kTinyBlock + 3), PrecisionPlan(2, 0));
  cache.fork(1, 2);
  cache.add_sequence(3, test::text(2 * kTinyBlock), PrecisionPlan(2, 0));
  cache.swap_out(3);
}

CacheConfig config() {
  CacheConfig c = tiny_config(2, 12);
  c.swap_blocks = {12, 4, 4};
  c.fp16_windows_first = true;
  return c;
}

struct Case {
  const char* name;
  std::function<void(KVCacheManager&)> call;
  // Run before the faults, to reach a path populate() does not.
  std::function<void(KVCacheManager&)> setup = nullptr;
};

class HostAllocFailure : public ::testing::TestWithParam<Case> {};

TEST_P(HostAllocFailure, ChangesNothing) {
  KVCacheManager cache(config());
  populate(cache);
  const Case& c = GetParam();
  if (c.setup) c.setup(cache);
  const long injected_before = g_injected;
  const long points = fail_each_allocation(cache, c.name, [&] { c.call(cache); });
  std::printf("%s: %ld allocation points, %ld injected failures\n", c.name, points, g_injected - injected_before);
  EXPECT_NO_THROW(cache.check_invariants());
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const std::vector<SequenceId> kBatch = {0, 1, 2};

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

// Every mutating call of the manager, and the const calls that allocate.
// Each prepares all its host memory (page lists, result vectors, slab
// records, the sequence's map node) before it takes a block, slab or host
// slot, so a std::bad_alloc at any allocation point changes nothing.
INSTANTIATE_TEST_SUITE_P(
    Calls, HostAllocFailure,
    ::testing::Values(
        Case{"add_sequence",
             [](KVCacheManager& m) {
               const TokenLayout layout({{TokenKind::Text, 3}, {TokenKind::Visual, 2 * kTinyBlock}});
               PrecisionPlan plan(2, 2);
               plan.set(1, 1, Precision::INT2);
               m.add_sequence(10, layout, plan);
             }},
        // Sequence 2 shares its partly filled tail with 1: a copy-on-write.
        Case{"append_tokens", [](KVCacheManager& m) { m.append_tokens(kBatch); }},
        Case{"swap_out", [](KVCacheManager& m) { m.swap_out(0); }},
        Case{"swap_in", [](KVCacheManager& m) { m.swap_in(3); }},
        Case{"demote",
             [](KVCacheManager& m) {
               const std::vector<Demotion> list = {{0, 0, 2, Precision::INT4}, {0, 1, 1, Precision::INT2}};
               m.demote(list);
             }},
        // Every tail full: a new FP16 block in every layer
        // (open_fp16_tails), by handle, compact slots.
        Case{"append_tokens_new_blocks",
             [](KVCacheManager& m) {
               const std::vector<SequenceHandle> batch = {m.handle(4), m.handle(0)};
               m.append_tokens(batch, AppendSlots::Compact);
             },
             [](KVCacheManager& m) { m.add_sequence(4, test::text(2 * kTinyBlock), PrecisionPlan(2, 0)); }},
        // No free slab left: grow() reclaims the empty INT4
        // and INT2 slabs that sequence 0 left behind.
        Case{"swap_in_reclaiming_slabs", [](KVCacheManager& m) { m.swap_in(3); },
             [](KVCacheManager& m) {
               m.free_sequence(0);
               m.add_sequence(5, test::text(18 * kTinyBlock), PrecisionPlan(2, 0));
               ASSERT_EQ(m.free_slabs(), 0);
               ASSERT_EQ(m.pool_stats(Precision::INT4).empty_slabs, 1);
             }},
        // Sequence 0's prompt is shared with its fork (swapped
        // out, so the blocks are 0's alone): demote copies it.
        Case{"demote_shared_prompt",
             [](KVCacheManager& m) {
               const std::vector<Demotion> list = {{0, 0, 2, Precision::INT2}, {0, 1, 1, Precision::INT4}};
               m.demote(list);
             },
             [](KVCacheManager& m) {
               m.fork(0, 12);
               m.swap_out(12);
             }},
        Case{"fork", [](KVCacheManager& m) { m.fork(0, 11); }},
        Case{"free_sequence", [](KVCacheManager& m) { m.free_sequence(0); }},
        Case{"decode_metadata", [](KVCacheManager& m) { (void)m.decode_metadata(kBatch); }},
        Case{"prefill_mapping", [](KVCacheManager& m) { (void)m.prefill_mapping(0, 1); }}),
    case_name);

// Prefix caching by content: a match that takes copies for another plan,
// publishing copies beside a node's FP16 one, and a plan demotion off a
// block that another sequence and the index share.
TEST(HostAllocFailure, PrefixCachingByContentChangesNothing) {
  CacheConfig c = config();
  c.arena_bytes *= 2;
  c.prefix_cache.enabled = true;
  c.prefix_cache.identity = PrefixIdentity::Content;
  KVCacheManager cache(c);
  const TokenLayout layout(
      {{TokenKind::Text, 2 * kTinyBlock}, {TokenKind::Visual, 3 * kTinyBlock}, {TokenKind::Text, 5}});
  std::vector<TokenKey> keys(static_cast<std::size_t>(layout.num_tokens()));
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = 100 + i;
  const PrecisionPlan fp16(2, 3);
  PrecisionPlan wanted(2, 3);
  wanted.set(0, 1, Precision::INT4);
  wanted.set(1, 2, Precision::INT2);
  cache.add_sequence(1, layout, fp16, keys, wanted);
  cache.publish_prefix(1, keys);
  std::vector<Demotion> plan1 = {{.id = 1, .layer = 0, .window = 1, .target = Precision::INT4},
                                 {.id = 1, .layer = 1, .window = 2, .target = Precision::INT2}};
  cache.demote(plan1);
  const long published = fail_each_allocation(cache, "publish_prefix (copies)", [&] { cache.publish_prefix(1, keys); });
  EXPECT_GT(published, 0);
  PrecisionPlan other(2, 3);
  other.set(0, 2, Precision::INT2);
  other.set(1, 1, Precision::INT4);
  fail_each_allocation(cache, "add_sequence (content hit)", [&] { cache.add_sequence(2, layout, fp16, keys, other); });
  ASSERT_EQ(cache.match_prefix(layout, fp16, keys, other).rows, 5 * kTinyBlock);
  cache.add_sequence(3, layout, fp16, keys, other);  // shares the FP16 blocks with 2
  const std::vector<Demotion> plan3 = {
      {.id = 3, .layer = 0, .window = 2, .target = Precision::INT2, .leave_shared = true},
      {.id = 3, .layer = 1, .window = 1, .target = Precision::INT4, .leave_shared = true}};
  fail_each_allocation(cache, "demote (leave_shared)", [&] { cache.demote(plan3); });
  EXPECT_NO_THROW(cache.check_invariants());
}

}  // namespace
}  // namespace mixkv
