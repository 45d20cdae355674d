// A randomized serving simulation: 10,000 requests of mixed sizes and plans
// (some text-only, with no plan: all FP16) arrive over time at a cache small
// enough to force demotion, swapping and preemption by recompute; a few
// percent fork 1-3 children once their prompt is done (parallel sampling);
// the engine (engine_sim.h) applies every step on real bytes. After every step the scheduler's and the manager's
// invariants hold and every pool conserves its blocks; at the end every request has finished or been rejected with a
// reason, exactly once, and every pool is whole again. Swapped blocks come back bit-identical (EngineSim checks).
// Both prefill modes: under Exact, chunked prompts are stored FP16 and demoted to their plans after the last chunk.
// With prefix caching, prompts are drawn from a few system texts, videos and plans with their content keys, so that
// admissions share cached blocks, which eviction reclaims under the same pressure.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine_sim.h"
#include "mixkv/core/errors.h"
#include "mixkv/scheduler/scheduler.h"
#include "scheduler_access.h"

namespace mixkv {
namespace {

struct Workload {
  std::uint64_t seed = 1;
  std::int32_t requests = 10000;
  SchedulingPolicy policy = SchedulingPolicy::FCFS;
  bool per_layer_slots = true;  // false: the engine has only the compact slots
  PrefillMode prefill = PrefillMode::Compact;
  bool prefix_caching = false;
  // Age tiers: old windows to INT4 in layer 0 and INT2 in layer 1.
  bool age_tiers = false;
  // Content: shared prompts' plans depend on the question, not the video.
  PrefixIdentity identity = PrefixIdentity::Precision;
};

// Age tiers shrink decode growth, so their runs get a smaller arena to meet
// the same pressure.
CacheConfig small_cache(bool prefix_caching, bool age_tiers, PrefixIdentity identity) {
  CacheConfig c;
  c.shape = CacheShape{2, 1, 16, 16};  // FP16 block 1 KiB, INT4 384 B, INT2 256 B
  c.slab_bytes = 4096;                 // 4 FP16, 10 INT4 or 16 INT2 blocks a slab
  c.arena_bytes = 4096 * static_cast<std::size_t>(age_tiers ? 20 : 28);
  c.swap_blocks = {16, 12, 12};  // small: some swaps fall back to recompute
  c.fp16_windows_first = true;
  c.prefix_cache.enabled = prefix_caching;
  c.prefix_cache.identity = identity;
  return c;
}

class Simulation {
 public:
  explicit Simulation(const Workload& w)
      : w_(w),
        rng_(w.seed),
        engine_(small_cache(w.prefix_caching, w.age_tiers, w.identity), config(w)),
        cache_(engine_.cache()),
        sched_(engine_.scheduler()) {}

  static SchedulerConfig config(const Workload& w) {
    SchedulerConfig c;
    c.max_num_seqs = 10;
    c.max_num_batched_tokens = 96;
    c.watermark = 0.0;
    c.policy = w.policy;
    c.per_layer_slots = w.per_layer_slots;
    c.prefill_mode = w.prefill;
    c.preemption = PreemptionMode::Swap;  // falls back to recompute when the host pool is full
    c.demote_under_pressure = true;
    c.max_demotions_per_step = 8;
    c.lookahead = 4;
    c.max_head_bypass = 16;
    if (w.age_tiers) {
      c.age_tiers.enabled = true;
      c.age_tiers.recent_windows = 1 + static_cast<std::int32_t>(w.seed % 2);
      c.age_tiers.layer_floor = {Precision::INT4, Precision::INT2};
    }
    return c;
  }

  // A prompt of a system text, a video and a question, each one of a few,
  // with the keys that name them and a plan that depends on the video.
  Request make_shared_request(RequestId id) {
    const std::int32_t bs = cache_.config().shape.block_size;
    const int system = pick(0, 2), video = pick(0, 3), question = pick(0, 5);
    const std::int32_t text = std::array{16, 32, 20}[static_cast<std::size_t>(system)];
    const std::int32_t visual = std::array{0, 48, 64, 101}[static_cast<std::size_t>(video)];
    const std::int32_t asked = 1 + question * 3;
    Request r;
    r.id = id;
    std::vector<Segment> segments{{TokenKind::Text, text}};
    if (visual > 0) segments.push_back({TokenKind::Visual, visual});
    segments.push_back({TokenKind::Text, asked});
    r.layout = TokenLayout(segments);
    for (std::int32_t i = 0; i < text; ++i) r.token_keys.push_back(1000 * (system + 1) + i);
    for (std::int32_t i = 0; i < visual; ++i) r.token_keys.push_back(100000 * (video + 1) + i);
    for (std::int32_t i = 0; i < asked; ++i) r.token_keys.push_back(10000000 + 1000 * question + i);
    if (pick(0, 9) == 0) r.token_keys.clear();  // a request that takes no part
    int family = pick(0, 1);
    if (w_.identity == PrefixIdentity::Content) family = question;
    PrecisionPlan plan(2, r.layout.num_windows(bs));
    for (std::int32_t win = 0; win < plan.num_windows(); ++win) {
      plan.set_score(win, static_cast<float>((video * 7 + win * 3) % 10) / 10.0f);
      for (std::int32_t layer = 0; layer < 2; ++layer) {
        const int p = (video + win * (layer + 1) + family) % 4;
        plan.set(layer, win, win == 0 || p == 0 ? Precision::FP16 : (p < 3 ? Precision::INT4 : Precision::INT2));
      }
    }
    r.plan = std::move(plan);
    r.max_new_tokens = pick(0, 4) == 0 ? pick(40, 120) : pick(1, 30);
    r.priority = pick(0, 3);
    r.arrival_time = static_cast<double>(id);
    return r;
  }

  Request make_request(RequestId id) {
    if (w_.prefix_caching && pick(0, 9) < 8) return make_shared_request(id);
    const std::int32_t bs = cache_.config().shape.block_size;
    std::vector<Segment> segments;
    if (pick(0, 3) > 0) segments.push_back({TokenKind::Text, pick(1, 20)});
    const int dice = pick(0, 99);
    // Mostly small, some large, ~1% that can never fit.
    const std::int32_t visual = dice < 1 ? pick(1500, 2500) : dice < 10 ? pick(96, 260) : pick(0, 90);
    if (visual > 0) segments.push_back({TokenKind::Visual, visual});
    segments.push_back({TokenKind::Text, pick(1, 12)});
    Request r;
    r.id = id;
    r.layout = TokenLayout(segments);
    const std::int32_t windows = r.layout.num_windows(bs);
    PrecisionPlan plan(2, windows);
    for (std::int32_t win = 0; win < windows; ++win) {
      plan.set_score(win, static_cast<float>(pick(0, 1000)) / 1000.0f);
      for (std::int32_t layer = 0; layer < 2; ++layer) {
        const int p = pick(0, 9);
        plan.set(layer, win, win == 0 || p < 5 ? Precision::FP16 : (p < 8 ? Precision::INT4 : Precision::INT2));
      }
    }
    // Some come with no plan: stored all FP16.
    if (pick(0, 99) >= 8) r.plan = std::move(plan);
    r.max_new_tokens = pick(0, 4) == 0 ? pick(40, 160) : pick(1, 30);
    r.priority = pick(0, 3);
    r.arrival_time = static_cast<double>(id);
    return r;
  }

  void run() {
    const auto t0 = std::chrono::steady_clock::now();
    RequestId next = 0;
    std::int64_t steps = 0;
    while (next < w_.requests || sched_.has_unfinished()) {
      // Arrivals: about 0.6 a step, a little more than the cache serves.
      for (int k = pick(0, 2); k > 0 && next < w_.requests; --k) {
        if (pick(0, 9) < 6) {
          const Request r = make_request(next);
          starts_[next] = r.layout.window_starts(cache_.config().shape.block_size);
          sched_.add_request(r);
          if (pick(0, 99) < 3) to_fork_[next] = pick(1, 3);
          live_.insert(next++);
        }
      }
      // The engine ends some requests early (EOS) and users cancel some, in whatever state.
      if (!live_.empty() && pick(0, 99) < 8) {
        // A random state first, so that rare states (swapped) get their share.
        // (A request whose first chunk started after a cached prefix counts
        // when it leaves before its prompt is done.)
        const auto wanted = static_cast<RequestState>(pick(0, 3));
        RequestId id = -1;
        for (const RequestId candidate : live_) {
          if (sched_.contains(candidate) && sched_.status(candidate).state == wanted) {
            id = candidate;
            if (pick(0, 3) == 0) break;
          }
        }
        if (id >= 0) {
          const RequestState state = sched_.status(id).state;
          ++cancelled_in_[static_cast<int>(state)];
          if (state == RequestState::Prefilling) first_hit_preempted_ += hit_prefilling_.erase(id);
          const bool cancel = pick(0, 1) == 0;
          ASSERT_TRUE(cancel ? sched_.cancel(id) : sched_.finish(id));
          ASSERT_FALSE(sched_.cancel(id)) << "cancel must be idempotent";
          engine_.forget(id);
        }
      }
      const StepOutput out = sched_.step();
      ++steps;
      engine_.apply(out, /*attention=*/steps % 8 == 0);
      if (testing::Test::HasFatalFailure()) return;
      record(out);
      ASSERT_NO_THROW(sched_.check_invariants()) << "after step " << steps;
      check_conservation();
      if (testing::Test::HasFatalFailure()) return;
      if (fork_ready()) {
        ASSERT_NO_THROW(sched_.check_invariants()) << "after the forks of step " << steps;
      }
      if (testing::Test::HasFatalFailure()) return;
      ASSERT_LT(steps, 2'000'000) << "the simulation does not drain";
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const SchedulerStats st = sched_.stats();
    std::printf(
        "seed %llu: %d requests, %lld steps, %lld finished, %lld rejected, %lld cancelled, %lld recompute "
        "preemptions, %lld swap preemptions (%lld blocks back bit-identical), %lld demotions (%lld INT4 -> INT2), "
        "%.1f s\n",
        static_cast<unsigned long long>(w_.seed), w_.requests, static_cast<long long>(steps),
        static_cast<long long>(st.finished), static_cast<long long>(st.rejected), static_cast<long long>(st.cancelled),
        static_cast<long long>(st.preempted_recompute), static_cast<long long>(st.preempted_swap),
        static_cast<long long>(engine_.blocks_swapped_back()), static_cast<long long>(st.demotions),
        static_cast<long long>(int4_to_int2_), seconds);
    std::printf("%lld plan demotions after exact prefill, %lld waits for their target blocks\n",
                static_cast<long long>(st.plan_demotions), static_cast<long long>(st.plan_waits));
    std::printf("cancelled/finished by the engine in state: waiting %d, prefilling %d, running %d, swapped %d\n",
                cancelled_in_[0], cancelled_in_[1], cancelled_in_[2], cancelled_in_[3]);
    std::printf("%lld children forked (%lld refused for want of a slot), %lld preemptions of forked requests\n",
                static_cast<long long>(st.forks), static_cast<long long>(slot_refusals_),
                static_cast<long long>(forked_preempted_));

    if (w_.prefix_caching) {
      const PrefixCacheStats pc = cache_.prefix_stats();
      std::printf(
          "prefix caching: %lld hits took %lld prompt rows from the cache (%lld computed), sharing %lld "
          "blocks; %lld published, %lld FP16 / %lld INT4 / %lld INT2 evicted\n",
          static_cast<long long>(st.prefix_hits), static_cast<long long>(st.cached_prompt_tokens),
          static_cast<long long>(st.prefill_tokens), static_cast<long long>(st.shared_blocks),
          static_cast<long long>(st.published_blocks), static_cast<long long>(pc.evicted[0]),
          static_cast<long long>(pc.evicted[1]), static_cast<long long>(pc.evicted[2]));
      EXPECT_GT(st.prefix_hits, 0);
      EXPECT_GT(pc.evicted[0] + pc.evicted[1] + pc.evicted[2], 0);
      EXPECT_GT(first_hit_preempted_, 0) << "no request preempted or cancelled while prefilling after a hit";
      // What is left is the index's alone.
      EXPECT_EQ(pc.cached, pc.evictable);
      engine_.cache().evict_prefix_cache();
    }
    // Every request and child left exactly once, rejected ones with a reason.
    EXPECT_EQ(reported_.size(), static_cast<std::size_t>(w_.requests + st.forks));
    for (RequestId id = 0; id < w_.requests + st.forks; ++id) EXPECT_EQ(reported_.count(id), 1u) << "request " << id;
    if (w_.age_tiers) {
      std::printf("age tiers: %lld demotions, %lld waits for their target blocks\n",
                  static_cast<long long>(st.age_demotions), static_cast<long long>(st.age_waits));
    }
    // No leak: every pool full, no ref count left, the host pool whole.
    for (const Precision p : kAllPrecisions) {
      EXPECT_EQ(cache_.pool_stats(p).used_blocks, 0) << to_string(p);
    }
    EXPECT_EQ(cache_.free_swap_slots(), cache_.config().swap_blocks);
    EXPECT_TRUE(cache_.sequence_ids().empty());
    // The cache was small enough to force every kind of pressure relief.
    EXPECT_GT(st.preempted_recompute, 0);
    EXPECT_GT(st.preempted_swap, 0);
    EXPECT_GT(engine_.blocks_swapped_back(), 0);
    if (w_.age_tiers) {
      EXPECT_GT(st.age_demotions, 0);
    } else {
      EXPECT_EQ(st.age_demotions, 0);
      // Age tiers relieve most of the pressure before it comes to this.
      EXPECT_GT(st.demotions, 0);
      EXPECT_GT(int4_to_int2_, 0);
    }
    EXPECT_GT(st.rejected, 0);
    EXPECT_GT(st.forks, 0);
    EXPECT_GT(forked_preempted_, 0);
    for (int s = 0; s < 4; ++s) EXPECT_GT(cancelled_in_[s], 0) << "no cancel in state " << s;
    if (w_.prefill == PrefillMode::Exact) {
      EXPECT_GT(st.plan_demotions, 0);
      EXPECT_GT(st.plan_waits, 0);
      EXPECT_GT(exact_recomputed_, 0) << "no request recomputed with its plan pending or prefilling FP16";
      EXPECT_GT(exact_swapped_, 0) << "no request swapped out with its plan pending or prefilling FP16";
    } else {
      EXPECT_EQ(st.plan_demotions, 0);
    }
  }

 private:
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // Requests marked to fork do so once they run (their prompt done): 1-3
  // children, with the parent's remaining tokens or a length of their own.
  // Without a free slot the fork waits for a later step. True when some
  // request forked.
  bool fork_ready() {
    bool forked = false;
    for (auto it = to_fork_.begin(); it != to_fork_.end();) {
      const RequestId parent = it->first;
      if (!sched_.contains(parent)) {
        it = to_fork_.erase(it);
        continue;
      }
      const RequestStatus st = sched_.status(parent);
      if (st.state != RequestState::Running) {
        ++it;
        continue;
      }
      const RequestId child = w_.requests + sched_.stats().forks;
      const std::int32_t more = pick(0, 1) == 0 ? -1 : pick(1, 40);
      try {
        sched_.fork(parent, child, more);
      } catch (const OutOfMemory&) {
        ++slot_refusals_;
        ++it;
        continue;
      } catch (const InvalidArgument& e) {
        // -1 for a parent at its last token, a child too long to ever
        // complete alone, or a parent whose plan is pending (exact prefill):
        // refused by name, nothing else is expected.
        const std::string what = e.what();
        EXPECT_TRUE(what.find("has generated all") != std::string::npos ||
                    what.find("plan is pending") != std::string::npos ||
                    what.find("could never complete alone") != std::string::npos)
            << what;
        ++it;
        continue;
      }
      engine_.inherit(child, parent);
      live_.insert(child);
      family_.insert(parent);
      family_.insert(child);
      forked = true;
      if (--it->second == 0) it = to_fork_.erase(it);
    }
    return forked;
  }

  void record(const StepOutput& out) {
    for (const RequestId id : out.swapped_out) {
      forked_preempted_ += family_.contains(id) ? 1 : 0;
      exact_swapped_ += sched_.contains(id) && sched_.status(id).plan_pending ? 1 : 0;
    }
    for (const RequestId id : out.preempted) forked_preempted_ += family_.contains(id) ? 1 : 0;
    for (const RequestId id : out.preempted) exact_recomputed_ += exact_before_.contains(id) ? 1 : 0;
    exact_before_.clear();
    for (const RequestId id : live_) {
      if (sched_.contains(id) && sched_.status(id).plan_pending) exact_before_.insert(id);
    }
    for (const FinishedRequest& f : out.finished) {
      EXPECT_TRUE(reported_.insert(f.id).second) << "request " << f.id << " reported twice";
      live_.erase(f.id);
    }
    for (const RejectedRequest& r : out.rejected) {
      EXPECT_TRUE(reported_.insert(r.id).second) << "request " << r.id << " reported twice";
      EXPECT_NE(r.reason.find("can never run"), std::string::npos) << r.reason;
      live_.erase(r.id);
    }
    // Chunks never start or end inside a visual window (a prefix from the
    // cache ends on a window boundary).
    for (const PrefillChunk& c : out.prefills) {
      for (const std::int32_t start : starts_.at(c.id < w_.requests ? c.id : 0)) {
        if (c.id >= w_.requests) break;  // a fork child is never prefilled from its own layout
        EXPECT_FALSE(c.start > start && c.start < start + 16) << "request " << c.id << " starts at " << c.start;
      }
      if (sched_.contains(c.id) && sched_.status(c.id).cached_tokens > 0 &&
          c.start == sched_.status(c.id).cached_tokens) {
        hit_prefilling_.insert(c.id);
      }
    }
    for (const RequestId id : out.preempted) first_hit_preempted_ += hit_prefilling_.erase(id);
    for (const RequestId id : out.swapped_out) first_hit_preempted_ += hit_prefilling_.erase(id);
    for (const PrefillChunk& c : out.prefills) {
      if (c.last) continue;
      for (const WindowSlot& w : c.mappings[0].int4_windows) EXPECT_LE(w.first_row + 16, c.end - c.start);
      for (const WindowSlot& w : c.mappings[0].int2_windows) EXPECT_LE(w.first_row + 16, c.end - c.start);
    }
    EXPECT_LE(out.num_batched_tokens, 96);
    EXPECT_LE(out.decodes.size(), 10u);
    // Plan demotions first, from FP16 windows only (pressure never touches
    // a window whose plan demotion is pending). Under pressure, INT4 ->
    // INT2 only once no FP16 window of the decoding requests is left to
    // demote.
    ASSERT_LE(out.plan_demotions, static_cast<std::int32_t>(out.demotions.size()));
    for (std::int32_t i = 0; i < out.plan_demotions; ++i) {
      EXPECT_EQ(out.demotions[static_cast<std::size_t>(i)].src_precision, Precision::FP16);
      EXPECT_NE(out.demotions[static_cast<std::size_t>(i)].window, 0);
    }
    // Age demotions next: FP16 windows or stream blocks to the layer's tier.
    const auto aged_end = static_cast<std::size_t>(out.plan_demotions + out.age_demotions);
    ASSERT_LE(aged_end, out.demotions.size());
    for (std::size_t i = static_cast<std::size_t>(out.plan_demotions); i < aged_end; ++i) {
      const DemoteOp& op = out.demotions[i];
      EXPECT_EQ(op.src_precision, Precision::FP16);
      EXPECT_EQ(op.dst_precision, op.layer == 0 ? Precision::INT4 : Precision::INT2);
      EXPECT_NE(op.window, 0);
      EXPECT_NE(std::find(out.tables_changed.begin(), out.tables_changed.end(), op.id), out.tables_changed.end());
    }
    if (!w_.age_tiers) {
      EXPECT_EQ(out.age_demotions, 0);
    }
    bool to_int2 = false;
    for (std::size_t i = aged_end; i < out.demotions.size(); ++i) {
      const DemoteOp& op = out.demotions[i];
      EXPECT_NE(op.window, 0);
      if (op.dst_precision == Precision::INT2) {
        EXPECT_EQ(op.src_precision, Precision::INT4);
        to_int2 = true;
        ++int4_to_int2_;
      }
    }
    for (const RequestId id : to_int2 ? out.decodes : std::vector<RequestId>{}) {
      if (!cache_.contains(id) || cache_.is_swapped(id)) continue;  // preempted after the demotions
      if (sched_.status(id).plan_pending) continue;                 // its FP16 windows wait for the plan
      const PrecisionPlan& plan = cache_.plan(id);
      if (waits_at_shared_window(id, plan)) continue;
      for (std::int32_t layer = 0; layer < plan.num_layers(); ++layer) {
        for (std::int32_t w = 1; w < plan.num_windows(); ++w) {
          if (plan.at(layer, w) != Precision::FP16) continue;
          EXPECT_TRUE(cache_.why_not_demotable(id, layer, w, Precision::INT4).has_value())
              << "step " << out.step << ": INT4 -> INT2 while request " << id << " layer " << layer << " window " << w
              << " could still go FP16 -> INT4";
        }
      }
    }
  }

  // Per pool: distinct blocks held by the scheduler's requests == used
  // blocks, each held by as many requests as its ref count (forks share),
  // and host slots held by swapped requests (never shared) == slots not free.
  void check_conservation() {
    BlockCounts device{};
    BlockCounts host{};
    for (const SequenceId id : cache_.sequence_ids()) {
      if (!cache_.is_swapped(id)) continue;
      const BlockCounts held = cache_.blocks_held(id);
      for (int p = 0; p < kNumPrecisions; ++p) host[p] += held[p];
    }
    const BlockCounts cached_only = cache_.prefix_stats().evictable;
    for (const Precision p : kAllPrecisions) {
      // Block ids stay below the arena's slabs times the pool's blocks a slab.
      holders_.resize(static_cast<std::size_t>(cache_.total_slabs()) * cache_.pool_stats(p).blocks_per_slab);
      touched_.clear();
      for (const SequenceId id : cache_.sequence_ids()) {
        if (cache_.is_swapped(id)) continue;
        for (std::int32_t layer = 0; layer < cache_.config().shape.num_layers; ++layer) {
          for (const std::int32_t b : cache_.blocks(id, layer, p)) {
            if (holders_[static_cast<std::size_t>(b)]++ == 0) touched_.push_back(b);
          }
        }
      }
      // The prefix index holds one more reference on a block it caches,
      // and alone the blocks no request holds.
      device[pool_index(p)] = static_cast<std::int64_t>(touched_.size()) + cached_only[pool_index(p)];
      for (const std::int32_t b : touched_) {
        const std::int32_t extra = cache_.ref_count(p, b) - holders_[static_cast<std::size_t>(b)];
        ASSERT_TRUE(extra == 0 || (w_.prefix_caching && extra == 1)) << to_string(p) << " block " << b;
        holders_[static_cast<std::size_t>(b)] = 0;
      }
    }
    const BlockCounts free_host = cache_.free_swap_slots();
    for (const Precision p : kAllPrecisions) {
      const PoolStats st = cache_.pool_stats(p);
      ASSERT_EQ(device[pool_index(p)], st.used_blocks) << to_string(p);
      ASSERT_EQ(st.used_blocks + st.free_blocks, static_cast<std::int64_t>(st.slabs) * st.blocks_per_slab);
      ASSERT_EQ(host[pool_index(p)] + free_host[pool_index(p)], cache_.config().swap_blocks[pool_index(p)]);
    }
  }

  // A request's FP16 -> INT4 demotion stops at a window another request
  // shares until they leave (pressure.cpp): its later windows wait.
  bool waits_at_shared_window(RequestId id, const PrecisionPlan& plan) {
    const scheduler_detail::Entry& e = test::SchedulerAccess::entry(sched_, id);
    if (e.demote_cursor >= e.demote_order.size()) return false;
    const std::int32_t w = e.demote_order[e.demote_cursor];
    for (std::int32_t layer = 0; layer < plan.num_layers(); ++layer) {
      if (plan.at(layer, w) != Precision::FP16) continue;
      const std::int32_t block = cache_.window_block(id, layer, w);
      if (cache_.ref_count(Precision::FP16, block) > 1 && cache_.why_not_demotable(id, layer, w, Precision::INT4)) {
        return true;
      }
    }
    return false;
  }

  Workload w_;
  std::mt19937_64 rng_;
  test::EngineSim engine_;
  KVCacheManager& cache_;
  Scheduler& sched_;
  std::set<RequestId> live_;
  std::set<RequestId> reported_;
  int cancelled_in_[5] = {};
  std::vector<std::int32_t> holders_;  // [block]: holders (check_conservation; zero between calls)
  std::vector<std::int32_t> touched_;
  std::map<RequestId, int> to_fork_;  // parent -> children still to fork
  std::set<RequestId> family_;        // requests that forked or were forked
  std::int64_t slot_refusals_ = 0;
  std::int64_t forked_preempted_ = 0;
  std::int64_t int4_to_int2_ = 0;
  std::set<RequestId> exact_before_;  // plan pending (exact prefill) before the step
  std::int64_t exact_recomputed_ = 0;
  std::int64_t exact_swapped_ = 0;
  std::map<RequestId, std::vector<std::int32_t>> starts_;  // window starts of each request's layout
  std::set<RequestId> hit_prefilling_;                     // first chunk after a cached prefix, prompt not done yet
  std::int64_t first_hit_preempted_ = 0;
};

TEST(SchedulerRandomized, TenThousandRequestsUnderPressure) {
  Simulation sim(Workload{1, 10000, SchedulingPolicy::FCFS});
  sim.run();
}

TEST(SchedulerRandomized, PriorityPolicyUnderPressure) {
  Simulation sim(Workload{2, 2000, SchedulingPolicy::Priority, /*per_layer_slots=*/false});
  sim.run();
}

// Exact prefill: chunked prompts held FP16, then demoted to their plans
// (retried when the pools cannot give the targets), under the same
// pressure, forks (refused while a parent's plan is pending), cancels,
// swaps and recomputes.
TEST(SchedulerRandomized, ExactPrefillUnderPressure) {
  Simulation sim(Workload{3, 4000, SchedulingPolicy::FCFS, /*per_layer_slots=*/true, PrefillMode::Exact});
  sim.run();
}

// Prefix caching: repeated system texts, videos and plans share cached
// blocks at admission, published blocks outlive their requests and are
// evicted under the same pressure (before any demotion or preemption),
// cancels and preemptions catch requests admitted with a hit, forks share
// cached prefixes.
TEST(SchedulerRandomized, PrefixCachingUnderPressure) {
  Simulation sim(Workload{5, 4000, SchedulingPolicy::FCFS, /*per_layer_slots=*/true, PrefillMode::Compact, true});
  sim.run();
}

TEST(SchedulerRandomized, PrefixCachingWithExactPrefill) {
  Simulation sim(Workload{6, 2000, SchedulingPolicy::Priority, /*per_layer_slots=*/false, PrefillMode::Exact, true});
  sim.run();
}

// Prefix caching by content: the same videos asked with plans that depend
// on the question share their FP16 copies while prefilled, then demote to
// their own plans or share the copies earlier questions published, under
// the same pressure, forks, cancels, swaps and recomputes.
TEST(SchedulerRandomized, PrefixCachingByContentUnderPressure) {
  Workload w{10, 3000, SchedulingPolicy::FCFS, /*per_layer_slots=*/true, PrefillMode::Exact, true};
  w.identity = PrefixIdentity::Content;
  Simulation sim(w);
  sim.run();
}

TEST(SchedulerRandomized, PrefixCachingByContentWithAgeTiers) {
  Workload w{11, 2000, SchedulingPolicy::Priority, /*per_layer_slots=*/false, PrefillMode::Exact, true};
  w.identity = PrefixIdentity::Content;
  w.age_tiers = true;
  Simulation sim(w);
  sim.run();
}

TEST(SchedulerRandomized, ExactPrefillPriorityPolicy) {
  Simulation sim(Workload{4, 2000, SchedulingPolicy::Priority, /*per_layer_slots=*/false, PrefillMode::Exact});
  sim.run();
}

// Age tiers under the same pressure: old windows and stream blocks demoted
// between steps beside plan demotions (Exact), pressure demotions, swaps,
// recomputes, forks and prefix hits; the invariants hold sinks, recent
// windows and tier precisions every step (Scheduler::check_invariants).
TEST(SchedulerRandomized, AgeTiersUnderPressure) {
  Workload w{7, 3000, SchedulingPolicy::FCFS};
  w.age_tiers = true;
  Simulation sim(w);
  sim.run();
}

TEST(SchedulerRandomized, AgeTiersWithExactPrefillAndPrefixCaching) {
  Workload w{8, 2000, SchedulingPolicy::Priority, /*per_layer_slots=*/false, PrefillMode::Exact, true};
  w.age_tiers = true;
  Simulation sim(w);
  sim.run();
}

TEST(SchedulerRandomized, AgeTiersWithPrefixCaching) {
  Workload w{9, 2000, SchedulingPolicy::FCFS, /*per_layer_slots=*/true, PrefillMode::Compact, true};
  w.age_tiers = true;
  Simulation sim(w);
  sim.run();
}

}  // namespace
}  // namespace mixkv
