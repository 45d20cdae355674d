// Randomized operations on small arenas: adds with random layouts and plans,
// append batches, forks, frees, bad ids and allocations meant to fail. After
// every operation the manager's invariants hold; after every failed call its
// state is unchanged. A shadow of the KV contents (one tag per token, written
// through the mappings the manager hands out, copies applied as AppendResult
// says) proves that no sequence's tokens are lost or overwritten, which is
// what copy-on-write and the free lists are for.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv {
namespace {

using test::to_vector;
using Tag = std::uint64_t;

struct Scenario {
  CacheShape shape;
  std::size_t slab_bytes;
  std::int32_t slabs;
  std::uint64_t seed;
  int operations;
};

class Harness {
 public:
  explicit Harness(const Scenario& s) : scenario_(s), cache_(make_config(s)), rng_(s.seed), bs_(s.shape.block_size) {
    for (const Precision p : kAllPrecisions) {
      const PoolStats stats = cache_.pool_stats(p);
      data_[static_cast<std::size_t>(pool_index(p))].assign(
          static_cast<std::size_t>(stats.blocks_per_slab) * cache_.total_slabs() * bs_, 0);
    }
  }

  void run() {
    for (int op = 0; op < scenario_.operations; ++op) {
      const std::string before = cache_.describe_state();
      const std::array<std::int32_t, kNumPrecisions> slabs_before = pool_slabs();
      const int dice = pick(0, 99);
      bool failed = false;
      if (dice < 30) {
        failed = add();
      } else if (dice < 60) {
        failed = append();
      } else if (dice < 70) {
        failed = fork();
      } else if (dice < 94) {
        failed = free_one();
      } else {
        read_only();
        failed = true;  // changes nothing either
      }
      ASSERT_NO_THROW(cache_.check_invariants()) << "after operation " << op;
      if (failed) {
        failures_ += dice < 94 ? 1 : 0;
        ASSERT_EQ(cache_.describe_state(), before) << "a failed call changed the state at operation " << op;
      }
      const std::array<std::int32_t, kNumPrecisions> slabs_after = pool_slabs();
      for (std::size_t p = 0; p < slabs_after.size(); ++p) reclaims_ += slabs_after[p] < slabs_before[p] ? 1 : 0;
      if (op % 4 == 0) verify_contents();
      if (testing::Test::HasFatalFailure()) return;
    }
    verify_contents();
    finish();
  }

  int failures() const { return failures_; }
  // Slabs that moved from one pool to another.
  int reclaims() const { return reclaims_; }
  int successes(int kind) const { return ok_[static_cast<std::size_t>(kind)]; }

 private:
  static CacheConfig make_config(const Scenario& s) {
    CacheConfig c;
    c.shape = s.shape;
    c.slab_bytes = s.slab_bytes;
    c.arena_bytes = s.slab_bytes * static_cast<std::size_t>(s.slabs);
    return c;
  }

  std::array<std::int32_t, kNumPrecisions> pool_slabs() const {
    std::array<std::int32_t, kNumPrecisions> slabs{};
    for (const Precision p : kAllPrecisions)
      slabs[static_cast<std::size_t>(pool_index(p))] = cache_.pool_stats(p).slabs;
    return slabs;
  }

  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  SequenceId random_live() {
    auto it = tokens_.begin();
    std::advance(it, pick(0, static_cast<int>(tokens_.size()) - 1));
    return it->first;
  }

  Tag& cell(Precision p, std::int64_t slot) { return data_[static_cast<std::size_t>(pool_index(p))][slot]; }

  TokenLayout random_layout() {
    std::vector<Segment> segments(static_cast<std::size_t>(pick(1, 4)));
    const bool huge = pick(0, 9) == 0;  // usually more than the arena holds
    for (Segment& s : segments) {
      s.kind = pick(0, 2) == 0 ? TokenKind::Text : TokenKind::Visual;
      s.length = huge ? pick(50, 600) : (pick(0, 3) == 0 ? pick(1, 8) : pick(1, 3 * bs_ + 5));
    }
    return TokenLayout(std::move(segments));
  }

  PrecisionPlan random_plan(const TokenLayout& layout) {
    PrecisionPlan plan(scenario_.shape.num_layers, layout.num_windows(bs_));
    const int mode = pick(0, 4);  // sometimes a whole prompt in one pool
    for (std::int32_t l = 0; l < plan.num_layers(); ++l) {
      for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
        plan.set(l, w, mode < 3 ? static_cast<Precision>(pick(0, 2)) : static_cast<Precision>(mode - 2));
      }
    }
    return plan;
  }

  bool add() {
    if (pick(0, 39) == 0 && !tokens_.empty()) {
      const SequenceId id = random_live();
      EXPECT_THROW(cache_.add_sequence(id, test::text(3), PrecisionPlan(scenario_.shape.num_layers, 0)),
                   InvalidArgument);
      return true;
    }
    const TokenLayout layout = random_layout();
    if (pick(0, 39) == 0) {
      PrecisionPlan wrong(scenario_.shape.num_layers, layout.num_windows(bs_) + 1);
      EXPECT_THROW(cache_.add_sequence(next_id_, layout, wrong), InvalidArgument);
      return true;
    }
    const PrecisionPlan plan = random_plan(layout);
    const BlockCounts need = cache_.demand(layout, plan);
    const bool fits = cache_.can_allocate(need);
    const SequenceId id = next_id_;
    try {
      cache_.add_sequence(id, layout, plan);
    } catch (const OutOfMemory&) {
      EXPECT_FALSE(fits) << "can_allocate said yes, add_sequence ran out of memory";
      return true;
    }
    EXPECT_TRUE(fits) << "can_allocate said no, add_sequence succeeded";
    ++next_id_;
    ++ok_[0];

    // Write one tag per prompt row through each layer's mapping; every row
    // goes to exactly one FP16 slot or one quantized window.
    std::vector<Tag> tags(static_cast<std::size_t>(layout.num_tokens()));
    for (Tag& t : tags) t = next_tag_++;
    for (std::int32_t layer = 0; layer < scenario_.shape.num_layers; ++layer) {
      const StoreMapping m = cache_.prefill_mapping(id, layer);
      EXPECT_EQ(m.fp16_slots.size(), tags.size());
      const auto counts = plan.window_counts(layer);
      EXPECT_EQ(static_cast<std::int32_t>(m.int4_windows.size()), counts[1]);
      EXPECT_EQ(static_cast<std::int32_t>(m.int2_windows.size()), counts[2]);
      std::vector<int> covered(tags.size(), 0);
      for (std::size_t r = 0; r < m.fp16_slots.size(); ++r) {
        if (m.fp16_slots[r] < 0) continue;
        cell(Precision::FP16, m.fp16_slots[r]) = tags[r];
        ++covered[r];
      }
      for (const Precision p : {Precision::INT4, Precision::INT2}) {
        for (const WindowSlot& w : p == Precision::INT4 ? m.int4_windows : m.int2_windows) {
          for (std::int32_t i = 0; i < bs_; ++i) {
            cell(p, std::int64_t{w.block_id} * bs_ + i) = tags[static_cast<std::size_t>(w.first_row + i)];
            ++covered[static_cast<std::size_t>(w.first_row + i)];
          }
        }
      }
      EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
    }
    tokens_[id] = std::move(tags);
    return false;
  }

  // New FP16 blocks an append of `ids` takes, counted independently of the
  // manager: a fresh block for an absent or full tail, a copy for a tail
  // still shared when this holder writes.
  std::int64_t append_need(const std::vector<SequenceId>& ids) const {
    std::int64_t need = 0;
    std::map<std::int32_t, std::int32_t> left;
    for (std::int32_t layer = 0; layer < scenario_.shape.num_layers; ++layer) {
      for (const SequenceId id : ids) {
        const auto blocks = cache_.blocks(id, layer, Precision::FP16);
        if (blocks.empty() || cache_.fp16_tail_fill(id, layer) == bs_) {
          ++need;
        } else if (cache_.ref_count(Precision::FP16, blocks.back()) - left[blocks.back()] > 1) {
          ++left[blocks.back()];
          ++need;
        }
      }
    }
    return need;
  }

  bool append() {
    if (tokens_.empty()) return add();
    std::vector<SequenceId> ids;
    for (const auto& [id, t] : tokens_) ids.push_back(id);
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(static_cast<std::size_t>(pick(1, std::min<int>(8, static_cast<int>(ids.size())))));
    const int twist = pick(0, 29);
    if (twist == 0) {
      ids.push_back(ids.front());
      EXPECT_THROW(cache_.append_tokens(ids), InvalidArgument);
      return true;
    }
    if (twist == 1) {
      ids.insert(ids.begin() + pick(0, static_cast<int>(ids.size())), next_id_ + 1000);
      EXPECT_THROW(cache_.append_tokens(ids), UnknownId);
      return true;
    }
    const bool fits = cache_.can_allocate({append_need(ids), 0, 0});
    // Either form; the compact one (offsets + the tails that changed) must
    // give the same slots as the per-layer one.
    const AppendSlots form = pick(0, 1) == 0 ? AppendSlots::PerLayer : AppendSlots::Compact;
    std::vector<std::vector<std::int32_t>> tails_before;
    for (const SequenceId id : ids) tails_before.push_back(to_vector(cache_.page_table(id).fp16_tails()));
    AppendResult r;
    try {
      r = cache_.append_tokens(ids, form);
    } catch (const OutOfMemory&) {
      EXPECT_FALSE(fits) << "append ran out of memory although the blocks were there";
      return true;
    }
    EXPECT_TRUE(fits) << "append succeeded although the count said no";
    ++ok_[1];
    // Copies first (they read the shared tails), then the new tokens.
    for (const BlockCopy& c : r.copies) {
      for (std::int32_t i = 0; i < bs_; ++i) {
        cell(Precision::FP16, std::int64_t{c.dst} * bs_ + i) = cell(Precision::FP16, std::int64_t{c.src} * bs_ + i);
      }
    }
    const auto layers = static_cast<std::size_t>(scenario_.shape.num_layers);
    EXPECT_EQ(r.slots.size(), form == AppendSlots::PerLayer ? layers : 0u);
    EXPECT_EQ(r.offsets.size(), ids.size());
    if (r.offsets.size() != ids.size()) return false;
    // tails_changed lists exactly the sequences whose tail moved in some
    // layer, with their tails now.
    std::vector<std::int32_t> changed;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (to_vector(cache_.page_table(ids[i]).fp16_tails()) != tails_before[i])
        changed.push_back(static_cast<std::int32_t>(i));
    }
    EXPECT_EQ(r.tails_changed, changed);
    EXPECT_EQ(r.tail_blocks.size(), r.tails_changed.size() * layers);
    for (std::size_t k = 0; k < r.tails_changed.size() && k < changed.size(); ++k) {
      const std::vector<std::int32_t> reported(r.tail_blocks.begin() + static_cast<std::ptrdiff_t>(k * layers),
                                               r.tail_blocks.begin() + static_cast<std::ptrdiff_t>((k + 1) * layers));
      EXPECT_EQ(reported, to_vector(cache_.page_table(ids[changed[k]]).fp16_tails()));
    }
    std::vector<Tag> tags;
    for (std::size_t i = 0; i < ids.size(); ++i) tags.push_back(next_tag_++);
    for (std::size_t layer = 0; layer < layers; ++layer) {
      if (form == AppendSlots::PerLayer) {
        EXPECT_EQ(r.slots[layer].size(), ids.size());
      }
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto layer_i = static_cast<std::int32_t>(layer);
        const std::int32_t tail = cache_.blocks(ids[i], layer_i, Precision::FP16).back();
        const std::int32_t slot = tail * bs_ + cache_.fp16_tail_fill(ids[i], layer_i) - 1;
        EXPECT_EQ(tail * bs_ + r.offsets[i], slot) << "compact form, layer " << layer << ", sequence " << i;
        if (form == AppendSlots::PerLayer) {
          EXPECT_EQ(r.slots[layer][i], slot);
        }
        cell(Precision::FP16, slot) = tags[i];
      }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) tokens_[ids[i]].push_back(tags[i]);
    return false;
  }

  bool fork() {
    if (tokens_.empty()) return add();
    const SequenceId parent = random_live();
    const int twist = pick(0, 19);
    if (twist == 0) {
      EXPECT_THROW(cache_.fork(parent, random_live()), InvalidArgument);
      return true;
    }
    if (twist == 1) {
      EXPECT_THROW(cache_.fork(next_id_ + 1000, next_id_), UnknownId);
      return true;
    }
    cache_.fork(parent, next_id_);
    tokens_[next_id_] = tokens_[parent];
    ++next_id_;
    ++ok_[2];
    return false;
  }

  bool free_one() {
    if (tokens_.empty() || pick(0, 19) == 0) {
      EXPECT_THROW(cache_.free_sequence(next_id_ + 7), UnknownId);
      return true;
    }
    const SequenceId id = random_live();
    cache_.free_sequence(id);
    tokens_.erase(id);
    ++ok_[3];
    return false;
  }

  // Decode metadata and bad layers: never change anything.
  void read_only() {
    if (tokens_.empty()) return;
    std::vector<SequenceId> ids{random_live()};
    if (tokens_.size() > 1) ids.push_back(random_live());
    if (ids.size() == 2 && ids[0] == ids[1]) {
      EXPECT_THROW((void)cache_.decode_metadata(ids), InvalidArgument);
      return;
    }
    const DecodeMetadata meta = cache_.decode_metadata(ids);
    for (std::int32_t layer = 0; layer < scenario_.shape.num_layers; ++layer) {
      for (const Precision p : kAllPrecisions) {
        const PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][static_cast<std::size_t>(pool_index(p))];
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto blocks = cache_.blocks(ids[i], layer, p);
          EXPECT_EQ(std::vector<std::int32_t>(t.indices.begin() + t.indptr[i], t.indices.begin() + t.indptr[i + 1]),
                    std::vector<std::int32_t>(blocks.begin(), blocks.end()));
          const std::int32_t last = blocks.empty()         ? 0
                                    : p == Precision::FP16 ? cache_.fp16_tail_fill(ids[i], layer)
                                                           : bs_;
          EXPECT_EQ(t.last_block_len[i], last);
        }
      }
    }
    EXPECT_THROW((void)cache_.prefill_mapping(ids[0], scenario_.shape.num_layers), IndexOutOfRange);
  }

  // Every live sequence finds exactly its own tokens in each layer's blocks.
  void verify_contents() {
    for (const auto& [id, expected] : tokens_) {
      std::vector<Tag> want = expected;
      std::sort(want.begin(), want.end());
      for (std::int32_t layer = 0; layer < scenario_.shape.num_layers; ++layer) {
        std::vector<Tag> got;
        for (const Precision p : kAllPrecisions) {
          const auto blocks = cache_.blocks(id, layer, p);
          for (std::size_t b = 0; b < blocks.size(); ++b) {
            const bool tail = p == Precision::FP16 && b + 1 == blocks.size();
            const std::int32_t n = tail ? cache_.fp16_tail_fill(id, layer) : bs_;
            for (std::int32_t i = 0; i < n; ++i) got.push_back(cell(p, std::int64_t{blocks[b]} * bs_ + i));
          }
        }
        std::sort(got.begin(), got.end());
        ASSERT_EQ(got, want) << "sequence " << id << " layer " << layer;
      }
    }
  }

  // Freeing everything leaves every block free and every slab obtainable by
  // any one pool (slabs move lazily, so they may still sit empty in a pool).
  void finish() {
    while (!tokens_.empty()) {
      cache_.free_sequence(tokens_.begin()->first);
      tokens_.erase(tokens_.begin());
      ASSERT_NO_THROW(cache_.check_invariants());
    }
    std::int32_t slabs = cache_.free_slabs();
    for (const Precision p : kAllPrecisions) {
      const PoolStats stats = cache_.pool_stats(p);
      EXPECT_EQ(stats.used_blocks, 0);
      EXPECT_EQ(stats.free_blocks, std::int64_t{stats.slabs} * stats.blocks_per_slab);
      slabs += stats.slabs;
      for (std::int32_t b = 0; b < stats.blocks_per_slab * cache_.total_slabs(); ++b) {
        ASSERT_EQ(cache_.ref_count(p, b), 0);
      }
      BlockCounts all{};
      all[static_cast<std::size_t>(pool_index(p))] = std::int64_t{stats.blocks_per_slab} * cache_.total_slabs();
      EXPECT_TRUE(cache_.can_allocate(all)) << to_string(p);
      ++all[static_cast<std::size_t>(pool_index(p))];
      EXPECT_FALSE(cache_.can_allocate(all)) << to_string(p);
    }
    EXPECT_EQ(slabs, cache_.total_slabs());
  }

  Scenario scenario_;
  KVCacheManager cache_;
  std::mt19937_64 rng_;
  std::int32_t bs_;
  std::map<SequenceId, std::vector<Tag>> tokens_;      // live sequences and their tokens
  std::array<std::vector<Tag>, kNumPrecisions> data_;  // shadow of every pool's token slots
  SequenceId next_id_ = 0;
  Tag next_tag_ = 1;
  int failures_ = 0;
  int reclaims_ = 0;
  std::array<int, 4> ok_{};
};

// 4 scenarios x 26,000 = 104,000 operations. Block sizes are 1 KiB (FP16)
// to 256 B (INT2) at head_dim 16, 2 KiB to 448 B at head_dim 32.
const Scenario kScenarios[] = {
    {{2, 1, 16, 16}, 4096, 12, 1, 26'000},  // 4 / 10 / 16 blocks per slab
    {{3, 1, 32, 16}, 4096, 16, 2, 26'000},  // 2 / 5 / 9
    {{1, 1, 16, 16}, 2048, 10, 3, 26'000},  // 2 / 5 / 8
    {{2, 1, 16, 32}, 8192, 10, 4, 26'000},  // block_size 32: 4 / 10 / 16
};

TEST(Randomized, HundredThousandOperationsKeepEveryInvariant) {
  const auto start = std::chrono::steady_clock::now();
  int total_failures = 0;
  for (const Scenario& s : kScenarios) {
    Harness h(s);
    h.run();
    if (testing::Test::HasFatalFailure()) return;
    total_failures += h.failures();
    std::printf("seed %llu: %d adds, %d appends, %d forks, %d frees, %d failed calls, %d slabs moved\n",
                static_cast<unsigned long long>(s.seed), h.successes(0), h.successes(1), h.successes(2), h.successes(3),
                h.failures(), h.reclaims());
    // The run exercised every kind of call, and failures on purpose.
    for (int kind = 0; kind < 4; ++kind) EXPECT_GT(h.successes(kind), 100) << "seed " << s.seed << " kind " << kind;
    EXPECT_GT(h.failures(), 1000) << "seed " << s.seed;
    EXPECT_GT(h.reclaims(), 100) << "seed " << s.seed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("seconds", std::to_string(seconds));
  std::printf("104,000 operations, %d failed calls, %.2f s\n", total_failures, seconds);
}

}  // namespace
}  // namespace mixkv
