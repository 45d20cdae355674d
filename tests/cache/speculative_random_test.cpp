// Randomized speculative decoding on small arenas: batches of several
// tokens per sequence (both slot forms, ids and handles), truncation to
// random lengths, forks, frees, and appends taken straight back. A shadow
// of the FP16 slots (one tag per decode token and layer, written where the
// manager says, copy-on-write copies applied first) proves that no
// sequence's tokens are lost or overwritten; a batch truncated straight
// back restores describe_state() whenever the append took no slab and
// copied no tail; a failed append changes nothing; invariants always hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_test_util.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv {
namespace {

using Tag = std::uint64_t;

Tag mix(Tag x) {
  x ^= x >> 31;
  x *= 0x9E3779B97F4A7C15ULL;
  return x ^ (x >> 29);
}

struct Model {
  std::int32_t prompt = 0;
  std::vector<Tag> decoded;  // one tag per appended token
};

class Harness {
 public:
  Harness(std::int32_t layers, std::int32_t slabs, std::uint64_t seed)
      : cache_(test::tiny_config(layers, slabs)), rng_(seed), layers_(layers) {}

  void run(int operations) {
    for (int op = 0; op < operations && !testing::Test::HasFailure(); ++op) {
      const int dice = pick(0, 99);
      if (dice < 15) {
        add();
      } else if (dice < 60) {
        append();
      } else if (dice < 78) {
        truncate();
      } else if (dice < 88) {
        fork();
      } else {
        free_one();
      }
      ASSERT_NO_THROW(cache_.check_invariants()) << "operation " << op;
      verify();
    }
    for (const auto& [id, model] : live_) cache_.free_sequence(id);
    for (const Precision p : kAllPrecisions) EXPECT_EQ(cache_.pool_stats(p).used_blocks, 0);
    EXPECT_NO_THROW(cache_.check_invariants());
  }

  int undone_exactly() const { return undone_; }

 private:
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  SequenceId any_live() {
    auto it = live_.begin();
    std::advance(it, pick(0, static_cast<int>(live_.size()) - 1));
    return it->first;
  }
  // The FP16 pool's slabs: an append that took one cannot be undone exactly.
  std::int32_t slabs_held() const { return cache_.pool_stats(Precision::FP16).slabs; }

  void add() {
    const SequenceId id = next_id_++;
    TokenLayout layout({{TokenKind::Text, pick(1, 40)}});
    if (pick(0, 1) == 1) layout = TokenLayout({{TokenKind::Text, pick(1, 9)}, {TokenKind::Visual, 16 * pick(1, 3)}});
    PrecisionPlan plan(layers_, layout.num_windows(test::kTinyBlock));
    for (std::int32_t l = 0; l < layers_; ++l) {
      for (std::int32_t w = 1; w < plan.num_windows(); ++w) plan.set(l, w, static_cast<Precision>(pick(0, 2)));
    }
    if (!cache_.can_allocate(cache_.demand(layout, plan))) return;
    cache_.add_sequence(id, layout, plan);
    live_[id].prompt = layout.num_tokens();
  }

  void append() {
    if (live_.empty()) return;
    std::vector<SequenceId> ids;
    for (const auto& [id, model] : live_) {
      if (pick(0, 2) != 0) ids.push_back(id);
    }
    std::shuffle(ids.begin(), ids.end(), rng_);
    std::vector<std::int32_t> counts;
    for (std::size_t i = 0; i < ids.size(); ++i) counts.push_back(pick(0, 3) == 0 ? 1 : pick(1, 40));
    const AppendSlots form = pick(0, 1) == 0 ? AppendSlots::PerLayer : AppendSlots::Compact;
    const std::string before = cache_.describe_state();
    const std::int32_t slabs = slabs_held();
    AppendResult r;
    try {
      if (pick(0, 1) == 0) {
        r = cache_.append_tokens(std::span<const SequenceId>(ids), std::span<const std::int32_t>(counts), form);
      } else {
        std::vector<SequenceHandle> handles;
        for (const SequenceId id : ids) handles.push_back(cache_.handle(id));
        r = cache_.append_tokens(std::span<const SequenceHandle>(handles), std::span<const std::int32_t>(counts), form);
      }
    } catch (const OutOfMemory&) {
      EXPECT_EQ(cache_.describe_state(), before) << "a failed append changed the cache";
      return;
    }
    for (const BlockCopy& c : r.copies) {
      for (std::int32_t t = 0; t < test::kTinyBlock; ++t) {
        shadow_[c.dst * test::kTinyBlock + t] = shadow_[c.src * test::kTinyBlock + t];
      }
    }
    std::size_t row = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const PageTable& t = cache_.page_table(ids[i]);
      Model& model = live_.at(ids[i]);
      for (std::int32_t j = 0; j < counts[i]; ++j, ++row) {
        model.decoded.push_back(mix(++tags_));
        for (std::int32_t l = 0; l < layers_; ++l) {
          const std::int32_t slot = t.fp16_slot(l, t.fp16_tokens(l) - counts[i] + j);
          if (form == AppendSlots::PerLayer) {
            ASSERT_EQ(r.slots[static_cast<std::size_t>(l)][row], slot) << "row " << row << " layer " << l;
          }
          shadow_[slot] = mix(model.decoded.back() + static_cast<Tag>(l));
        }
      }
      ASSERT_EQ(r.offsets[i], (cache_.num_tokens(ids[i]) - counts[i]) % test::kTinyBlock);
    }
    if (pick(0, 2) != 0) return;
    // Straight back, the whole batch at once.
    std::vector<std::int32_t> back;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      back.push_back(cache_.num_tokens(ids[i]) - counts[i]);
      Model& model = live_.at(ids[i]);
      model.decoded.resize(model.decoded.size() - static_cast<std::size_t>(counts[i]));
    }
    cache_.truncate(std::span<const SequenceId>(ids), std::span<const std::int32_t>(back));
    if (r.copies.empty() && slabs_held() == slabs) {
      EXPECT_EQ(cache_.describe_state(), before) << "append then truncate did not restore the state";
      ++undone_;
    }
  }

  void truncate() {
    if (live_.empty()) return;
    const SequenceId id = any_live();
    Model& model = live_.at(id);
    const std::int32_t keep = pick(0, static_cast<int>(model.decoded.size()));
    cache_.truncate(id, model.prompt + keep);
    model.decoded.resize(static_cast<std::size_t>(keep));
  }

  void fork() {
    if (live_.empty()) return;
    const SequenceId parent = any_live();
    const SequenceId child = next_id_++;
    cache_.fork(parent, child);
    live_[child] = live_.at(parent);
  }

  void free_one() {
    if (live_.empty()) return;
    const SequenceId id = any_live();
    cache_.free_sequence(id);
    live_.erase(id);
  }

  // Every decode token of every sequence reads back its own tag in every layer.
  void verify() {
    for (const auto& [id, model] : live_) {
      const PageTable& t = cache_.page_table(id);
      ASSERT_EQ(cache_.num_tokens(id), model.prompt + static_cast<std::int32_t>(model.decoded.size()));
      const auto n = static_cast<std::int64_t>(model.decoded.size());
      for (std::int32_t l = 0; l < layers_; ++l) {
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int32_t slot = t.fp16_slot(l, t.fp16_tokens(l) - n + k);
          ASSERT_EQ(shadow_[slot], mix(model.decoded[static_cast<std::size_t>(k)] + static_cast<Tag>(l)))
              << "sequence " << id << " layer " << l << " decode token " << k << " was overwritten";
        }
      }
    }
  }

  KVCacheManager cache_;
  std::mt19937_64 rng_;
  std::int32_t layers_;
  std::map<SequenceId, Model> live_;
  std::unordered_map<std::int32_t, Tag> shadow_;  // FP16 slot -> tag
  SequenceId next_id_ = 1;
  Tag tags_ = 0;
  int undone_ = 0;
};

TEST(SpeculativeRandom, TokensSurviveAndAppendsUndoExactly) {
  int undone = 0;
  for (std::uint64_t seed = 1; seed <= 24; ++seed) {
    Harness h(static_cast<std::int32_t>(1 + seed % 3), static_cast<std::int32_t>(6 + seed % 10), seed);
    h.run(400);
    undone += h.undone_exactly();
    if (testing::Test::HasFailure()) {
      ADD_FAILURE() << "seed " << seed;
      break;
    }
  }
  EXPECT_GT(undone, 50) << "too few appends were undone exactly for the test to mean much";
}

}  // namespace
}  // namespace mixkv
