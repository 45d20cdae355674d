// Fault injection on the manager with the CPU backend (docs/reliability.md):
// the arena running out of slabs in every call that allocates (add_sequence,
// append_tokens with and without copy-on-write, swap_in, demote), at every
// arena size for one scripted workload, and the host swap pool running full.
// Each fault must be an OutOfMemory that names the pool, that can_allocate()
// predicted, that changes neither the bookkeeping (describe_state) nor any
// sequence's bytes (HostBackend::snapshot), and after which the memory is
// whole again once everything is freed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../cache/cache_test_util.h"
#include "host_backend.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

using test::HostBackend;
using test::kTinyBlock;
using test::tiny_config;

TokenLayout visual(std::int32_t n) { return TokenLayout({{TokenKind::Visual, n}}); }

PrecisionPlan uniform_plan(std::int32_t layers, const TokenLayout& layout, Precision p) {
  return PrecisionPlan(layers, layout.num_windows(kTinyBlock), p);
}

// Runs `call`, which must throw OutOfMemory naming `pool`; then nothing may
// have changed: bookkeeping, invariants, every sequence's bytes.
template <class F>
void expect_oom_changes_nothing(HostBackend& backend, F&& call, const std::string& pool) {
  const std::string state = backend.cache().describe_state();
  const auto bytes = backend.snapshot_all();
  try {
    call();
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find(pool), std::string::npos) << e.what();
  }
  EXPECT_EQ(backend.cache().describe_state(), state);
  EXPECT_NO_THROW(backend.cache().check_invariants());
  EXPECT_EQ(backend.snapshot_all(), bytes) << "a failed call changed some sequence's bytes";
}

// Every block free again, every slab accounted for, every host slot free.
void expect_whole(const KVCacheManager& cache) {
  std::int32_t slabs = cache.free_slabs();
  for (const Precision p : kAllPrecisions) {
    const PoolStats st = cache.pool_stats(p);
    EXPECT_EQ(st.used_blocks, 0) << to_string(p);
    EXPECT_EQ(st.free_blocks, static_cast<std::int64_t>(st.slabs) * st.blocks_per_slab) << to_string(p);
    slabs += st.slabs;
  }
  EXPECT_EQ(slabs, cache.total_slabs());
  EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
  EXPECT_TRUE(cache.sequence_ids().empty());
  EXPECT_NO_THROW(cache.check_invariants());
}

// --- Arena exhaustion, call by call

class AddUntilFull : public ::testing::TestWithParam<Precision> {};

// Sequences of one pool until the arena is full: the first add that does not
// fit fails whole, exactly when can_allocate said so; after freeing
// everything the same number fits again (no capacity lost).
TEST_P(AddUntilFull, FailsWholeAtTheBoundaryAndLosesNoCapacity) {
  const Precision p = GetParam();
  HostBackend backend(tiny_config(2, 3));
  KVCacheManager& cache = backend.cache();
  // 3 windows (FP16: 3 blocks a layer) plus a 5-token FP16 tail.
  const TokenLayout layout({{TokenKind::Visual, 3 * kTinyBlock + 5}});
  const PrecisionPlan plan = uniform_plan(2, layout, p);
  int fitted[2] = {0, 0};
  for (int round = 0; round < 2; ++round) {
    for (SequenceId id = 0;; ++id) {
      const bool predicted = cache.can_allocate(cache.demand(layout, plan));
      if (!predicted) {
        expect_oom_changes_nothing(
            backend, [&] { backend.add(id, layout, plan); }, "out of memory");
        break;
      }
      ASSERT_NO_THROW(backend.add(id, layout, plan));
      ++fitted[round];
      ASSERT_LT(id, 100);
    }
    for (const SequenceId id : cache.sequence_ids()) backend.free(id);
    expect_whole(cache);
  }
  EXPECT_GT(fitted[0], 0);
  EXPECT_EQ(fitted[0], fitted[1]);
}

INSTANTIATE_TEST_SUITE_P(Pools, AddUntilFull, ::testing::Values(Precision::FP16, Precision::INT4, Precision::INT2),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// A batch in which one sequence needs a new FP16 block and none is left:
// no sequence of the batch gets its token.
TEST(ArenaExhaustion, AppendBatchIsAllOrNothing) {
  HostBackend backend(tiny_config(1, 1));  // 4 FP16 blocks in all
  KVCacheManager& cache = backend.cache();
  const PrecisionPlan none(1, 0);
  backend.add(0, test::text(5), none);               // tail has room
  backend.add(1, test::text(kTinyBlock), none);      // tail full
  backend.add(2, test::text(2 * kTinyBlock), none);  // the last free block
  ASSERT_FALSE(cache.can_allocate({1, 0, 0}));
  expect_oom_changes_nothing(
      backend,
      [&] {
        backend.append({0, 1});
      },
      "FP16 pool");
  EXPECT_EQ(cache.num_tokens(0), 5);
  // The sequence with room alone still appends.
  ASSERT_NO_THROW(backend.append({0}));
  EXPECT_EQ(cache.num_tokens(0), 6);
  for (const SequenceId id : cache.sequence_ids()) backend.free(id);
  expect_whole(cache);
}

// Copy-on-write needs a block too: a forked child appending into a shared,
// partly filled tail fails whole when none is free; once one is, the copy
// isolates the parent from the child's token.
TEST(ArenaExhaustion, CopyOnWriteWithoutRoom) {
  HostBackend backend(tiny_config(1, 1));
  KVCacheManager& cache = backend.cache();
  const PrecisionPlan none(1, 0);
  backend.add(0, test::text(kTinyBlock + 3), none);  // 2 blocks, tail partly filled
  cache.fork(0, 1);
  backend.add(2, test::text(2 * kTinyBlock), none);  // the last 2 blocks
  const std::int32_t tail = cache.blocks(0, 0, Precision::FP16).back();
  ASSERT_EQ(cache.ref_count(Precision::FP16, tail), 2);
  expect_oom_changes_nothing(
      backend, [&] { backend.append({1}); }, "FP16 pool");
  EXPECT_EQ(cache.ref_count(Precision::FP16, tail), 2);

  backend.free(2);
  const std::vector<std::byte> parent = backend.snapshot(0);
  const AppendResult r = backend.append({1});
  ASSERT_EQ(r.copies.size(), 1u);
  EXPECT_EQ(r.copies[0].src, tail);
  EXPECT_EQ(backend.snapshot(0), parent) << "the child's token reached the parent's blocks";
  // The child's private tail starts as the parent's: the 3 shared tokens
  // (K and V rows of 16 halves) are the same bytes, and the fourth is its own.
  const std::int32_t copy = cache.blocks(1, 0, Precision::FP16).back();
  EXPECT_EQ(copy, r.copies[0].dst);
  const std::size_t row = 16 * sizeof(Half);
  const std::size_t v_plane = 16 * row;
  for (const std::size_t plane : {std::size_t{0}, v_plane}) {
    EXPECT_EQ(0, std::memcmp(backend.block(Precision::FP16, copy) + plane, backend.block(Precision::FP16, tail) + plane,
                             3 * row));
    EXPECT_NE(0, std::memcmp(backend.block(Precision::FP16, copy) + plane + 3 * row,
                             backend.block(Precision::FP16, tail) + plane + 3 * row, row));
  }
  for (const SequenceId id : cache.sequence_ids()) backend.free(id);
  expect_whole(cache);
}

// swap_in into a full arena fails whole (the host copy stays where it was);
// once there is room the sequence comes back bit-identical.
TEST(ArenaExhaustion, SwapInWaitsForRoomAndComesBackIdentical) {
  CacheConfig config = tiny_config(2, 4);
  config.swap_blocks = {8, 8, 8};
  HostBackend backend(config);
  KVCacheManager& cache = backend.cache();
  const TokenLayout layout({{TokenKind::Text, 7}, {TokenKind::Visual, 2 * kTinyBlock}});
  PrecisionPlan plan(2, 2);
  plan.set(0, 1, Precision::INT4);
  plan.set(1, 1, Precision::INT2);
  backend.add(0, layout, plan);
  backend.append({0});
  const std::vector<std::byte> before = backend.snapshot(0);
  backend.swap_out(0);
  // Fill the arena: FP16 text sequences until nothing fits.
  SequenceId next = 1;
  while (cache.can_allocate({1, 0, 0})) backend.add(next++, test::text(kTinyBlock), PrecisionPlan(2, 0));
  ASSERT_FALSE(cache.can_allocate(cache.blocks_held(0)));
  expect_oom_changes_nothing(
      backend, [&] { backend.swap_in(0); }, "out of memory");
  EXPECT_TRUE(cache.is_swapped(0));

  for (SequenceId id = 1; id < next; ++id) backend.free(id);
  ASSERT_TRUE(cache.can_allocate(cache.blocks_held(0)));
  backend.swap_in(0);
  EXPECT_EQ(backend.snapshot(0), before);
  backend.free(0);
  expect_whole(cache);
}

// demote takes its target blocks first: with none to be had it fails whole.
TEST(ArenaExhaustion, DemoteWithoutTargetBlocks) {
  CacheConfig config = tiny_config(1, 1);
  config.fp16_windows_first = true;
  HostBackend backend(config);
  KVCacheManager& cache = backend.cache();
  const TokenLayout layout = visual(4 * kTinyBlock);  // the whole FP16 slab
  backend.add(0, layout, uniform_plan(1, layout, Precision::FP16));
  ASSERT_FALSE(cache.why_not_demotable(0, 0, 1, Precision::INT4).has_value());
  expect_oom_changes_nothing(
      backend,
      [&] {
        backend.demote({{0, 0, 1, Precision::INT4}});
      },
      "INT4 pool");
  EXPECT_EQ(cache.plan(0).at(0, 1), Precision::FP16);
  backend.free(0);
  expect_whole(cache);
}

// One seeded workload (adds of every pool mix, appends, forks, frees, swaps,
// demotions) on every arena size from 1 to 12 slabs, so that the arena runs
// out at a different call each time: every OutOfMemory of add_sequence and
// swap_in was predicted by can_allocate, every one changed neither the
// bookkeeping nor any sequence's bytes, and freeing everything at the end
// leaves the memory whole.
TEST(ArenaExhaustion, EveryArenaSizeFailsCleanly) {
  std::int64_t calls = 0;
  std::int64_t faults = 0;
  for (std::int32_t slabs = 1; slabs <= 12; ++slabs) {
    CacheConfig config = tiny_config(2, slabs);
    config.swap_blocks = {6, 4, 4};
    config.fp16_windows_first = true;
    HostBackend backend(config);
    KVCacheManager& cache = backend.cache();
    std::mt19937_64 rng(42);  // the same script on every size
    auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    std::vector<SequenceId> live;
    SequenceId next = 0;
    for (int op = 0; op < 400; ++op) {
      const std::string state = cache.describe_state();
      const auto bytes = backend.snapshot_all();
      bool failed = false;
      ++calls;
      try {
        const int dice = pick(0, 99);
        if (dice < 30 || live.empty()) {
          std::vector<Segment> segments;
          if (pick(0, 2) > 0) segments.push_back({TokenKind::Text, pick(1, 20)});
          segments.push_back({TokenKind::Visual, pick(1, 5 * kTinyBlock)});
          const TokenLayout layout(segments);
          PrecisionPlan plan(2, layout.num_windows(kTinyBlock));
          for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
            for (std::int32_t l = 0; l < 2; ++l) plan.set(l, w, static_cast<Precision>(pick(0, 2)));
          }
          const bool predicted = cache.can_allocate(cache.demand(layout, plan));
          try {
            backend.add(next, layout, plan);
          } catch (const OutOfMemory&) {
            EXPECT_FALSE(predicted) << "can_allocate said yes, add_sequence ran out of memory";
            throw;
          }
          EXPECT_TRUE(predicted);
          live.push_back(next++);
        } else {
          const SequenceId id = live[static_cast<std::size_t>(pick(0, static_cast<int>(live.size()) - 1))];
          if (dice < 55) {
            std::vector<SequenceId> batch;
            for (const SequenceId s : live) {
              if (!cache.is_swapped(s) && pick(0, 1) == 0) batch.push_back(s);
            }
            backend.append(batch);
          } else if (dice < 63) {
            if (!cache.is_swapped(id)) {
              cache.fork(id, next);
              live.push_back(next++);
            }
          } else if (dice < 78) {
            backend.free(id);
            std::erase(live, id);
          } else if (dice < 88) {
            if (cache.is_swapped(id)) {
              const bool predicted = cache.can_allocate(cache.blocks_held(id));
              try {
                backend.swap_in(id);
              } catch (const OutOfMemory&) {
                EXPECT_FALSE(predicted);
                throw;
              }
              EXPECT_TRUE(predicted);
            } else {
              backend.swap_out(id);
            }
          } else if (!cache.is_swapped(id) && cache.plan(id).num_windows() > 1) {
            const std::int32_t window = pick(1, cache.plan(id).num_windows() - 1);
            const Precision target = pick(0, 1) == 0 ? Precision::INT4 : Precision::INT2;
            if (!cache.why_not_demotable(id, 0, window, target)) backend.demote({{id, 0, window, target}});
          }
        }
      } catch (const OutOfMemory&) {
        failed = true;
        ++faults;
      }
      ASSERT_NO_THROW(cache.check_invariants()) << slabs << " slabs, operation " << op;
      if (failed) {
        ASSERT_EQ(cache.describe_state(), state) << slabs << " slabs, operation " << op;
        ASSERT_EQ(backend.snapshot_all(), bytes) << slabs << " slabs, operation " << op;
      }
    }
    for (const SequenceId id : live) backend.free(id);
    expect_whole(cache);
  }
  std::printf("arena sizes 1-12 slabs: %lld calls, %lld OutOfMemory faults, each changing nothing\n",
              static_cast<long long>(calls), static_cast<long long>(faults));
  EXPECT_GT(faults, 100);
}

// --- Host swap pool full

// The host pool fits the first sequence, not the second: swap_out of the
// second fails whole (still resident, its bytes and the first one's host
// copy untouched); once the first is freed from the host, it fits.
TEST(SwapPoolFull, SwapOutFailsWholeAndLeavesBothCopies) {
  CacheConfig config = tiny_config(1, 4);
  config.swap_blocks = {3, 2, 2};
  HostBackend backend(config);
  KVCacheManager& cache = backend.cache();
  const PrecisionPlan none(1, 0);
  backend.add(0, test::text(2 * kTinyBlock + 1), none);  // 3 FP16 blocks: exactly the host pool
  backend.add(1, test::text(kTinyBlock), none);          // 1 FP16 block
  const std::vector<std::byte> first = backend.snapshot(0);
  backend.swap_out(0);
  EXPECT_EQ(cache.free_swap_slots(), (BlockCounts{0, 2, 2}));
  EXPECT_EQ(backend.snapshot(0), first);
  expect_oom_changes_nothing(
      backend, [&] { backend.swap_out(1); }, "FP16 swap pool");
  EXPECT_FALSE(cache.is_swapped(1));

  backend.free(0);  // frees host slots
  EXPECT_EQ(cache.free_swap_slots(), config.swap_blocks);
  const std::vector<std::byte> second = backend.snapshot(1);
  backend.swap_out(1);
  backend.swap_in(1);
  EXPECT_EQ(backend.snapshot(1), second);
  backend.free(1);
  expect_whole(cache);
}

// Each pool's host slots are checked on their own: room for FP16 does not
// help a sequence whose INT2 blocks do not fit.
TEST(SwapPoolFull, EachPoolOnItsOwn) {
  CacheConfig config = tiny_config(2, 4);
  config.swap_blocks = {16, 16, 1};
  HostBackend backend(config);
  KVCacheManager& cache = backend.cache();
  const TokenLayout layout = visual(kTinyBlock);
  backend.add(0, layout, uniform_plan(2, layout, Precision::INT2));  // 2 INT2 blocks (one a layer)
  expect_oom_changes_nothing(
      backend, [&] { backend.swap_out(0); }, "INT2 swap pool");
  backend.free(0);
  expect_whole(cache);
}

// Without a host pool (the default), swapping is an OutOfMemory, not a crash.
TEST(SwapPoolFull, NoHostPool) {
  HostBackend backend(tiny_config(1, 2));
  KVCacheManager& cache = backend.cache();
  backend.add(0, test::text(3), PrecisionPlan(1, 0));
  expect_oom_changes_nothing(
      backend, [&] { backend.swap_out(0); }, "swap pool");
  backend.free(0);
  expect_whole(cache);
}

// Filling the host pool exactly, slot by slot, and emptying it in another
// order: every round trip is bit-identical and no slot is lost.
TEST(SwapPoolFull, ExactFitRoundTrips) {
  CacheConfig config = tiny_config(1, 6);
  config.swap_blocks = {6, 0, 0};
  HostBackend backend(config);
  KVCacheManager& cache = backend.cache();
  for (SequenceId id = 0; id < 6; ++id)
    backend.add(id, test::text(1 + static_cast<std::int32_t>(id)), PrecisionPlan(1, 0));
  const auto before = backend.snapshot_all();
  for (SequenceId id = 0; id < 6; ++id) backend.swap_out(id);
  EXPECT_EQ(cache.free_swap_slots(), (BlockCounts{0, 0, 0}));
  backend.add(6, test::text(1), PrecisionPlan(1, 0));
  expect_oom_changes_nothing(
      backend, [&] { backend.swap_out(6); }, "FP16 swap pool");
  backend.free(6);
  for (const SequenceId id : {3, 0, 5, 1, 4, 2}) backend.swap_in(id);
  EXPECT_EQ(backend.snapshot_all(), before);
  for (SequenceId id = 0; id < 6; ++id) backend.free(id);
  expect_whole(cache);
}

}  // namespace
}  // namespace mixkv
