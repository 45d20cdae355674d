// Prefix caching under random calls: prompts drawn from a few system texts,
// videos, plans and questions (so that prefixes repeat), added with their
// keys, published, appended to, forked, truncated, demoted, swapped out and
// in, freed, in a cache small enough to evict. A shadow of the KV bytes
// (one tag per FP16 slot and per quantized block, a function of the row's
// whole prefix) is written wherever the caller would write, and every
// resident sequence must read back its own tags after every call: a shared
// block holds exactly what the sharer would have computed, no write lands
// in a block anyone else holds (the index included), and an evicted block
// is never served. check_invariants() after every call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <unordered_map>
#include <vector>

#include "cache_test_util.h"
#include "mixkv/core/hash.h"

namespace mixkv::test {
namespace {

struct Seq {
  TokenLayout layout;
  std::vector<TokenKey> keys;
  std::vector<std::uint64_t> prefix;  // [row]: hash of rows 0..row (kind and key, or a salt past the keys)
  std::vector<std::uint64_t> decode;  // [position - prompt]: tag of each appended token
  std::uint64_t salt = 0;
};

class Harness {
 public:
  Harness(std::uint32_t seed, KVCacheManager& cache) : rng_(seed), cache_(cache) {
    bs_ = cache.config().shape.block_size;
    layers_ = cache.config().shape.num_layers;
  }

  void run(int calls) {
    for (int call = 0; call < calls && !testing::Test::HasFailure(); ++call) {
      const std::string before = cache_.describe_state();
      bool unchanged = false;
      switch (pick(10)) {
        case 0:
        case 1:
        case 2: unchanged = !add(); break;
        case 3: publish(); break;
        case 4: unchanged = !append(); break;
        case 5: fork(); break;
        case 6: free_one(); break;
        case 7: unchanged = !swap(); break;
        case 8: demote(); break;
        default:
          if (pick(4) == 0) cache_.evict_prefix_cache();
          truncate();
          break;
      }
      if (unchanged) {
        ASSERT_EQ(cache_.describe_state(), before) << "a failed call changed the state";
      }
      ASSERT_NO_THROW(cache_.check_invariants());
      verify();
    }
  }

  std::int64_t hits = 0;

 private:
  int pick(int n) { return static_cast<int>(rng_() % static_cast<unsigned>(n)); }

  std::uint64_t slot_tag(const Seq& s, std::int32_t row, std::int32_t layer) const {
    return mix64(s.prefix[static_cast<std::size_t>(row)] ^ (std::uint64_t(layer) << 56));
  }
  std::uint64_t window_tag(const Seq& s, std::int32_t first_row, std::int32_t layer, Precision p) const {
    return mix64(slot_tag(s, first_row + bs_ - 1, layer) + static_cast<std::uint64_t>(pool_index(p)) + 1);
  }
  std::uint64_t decode_tag(const Seq& s, std::size_t k, std::int32_t layer) const {
    return mix64(s.decode[k] ^ (std::uint64_t(layer) << 56) ^ 0x77);
  }

  // Writes `tag` at a slot or block the sequence alone holds.
  void write_slot(std::int32_t slot, std::uint64_t tag) {
    ASSERT_EQ(cache_.ref_count(Precision::FP16, slot / bs_), 1) << "a write into a shared FP16 block";
    fp16_[slot] = tag;
  }
  void write_block(Precision p, std::int32_t block, std::uint64_t tag) {
    ASSERT_EQ(cache_.ref_count(p, block), 1) << "a write into a shared " << to_string(p) << " block";
    quant_[static_cast<std::size_t>(pool_index(p))][block] = tag;
  }

  Seq make_prompt(SequenceId id) {
    Seq s;
    const int system = pick(2), video = pick(2), question = pick(4);
    const std::int32_t text = system == 0 ? 32 : (pick(3) == 0 ? 20 : 16);
    const std::int32_t windows = std::array{0, 1, 2, 3, 3}[static_cast<std::size_t>(pick(5))];
    const std::int32_t tail = pick(3) == 0 ? 5 : 0, q = 1 + pick(20);
    std::vector<Segment> segments{{TokenKind::Text, text}};
    if (windows * bs_ + tail > 0) segments.push_back({TokenKind::Visual, windows * bs_ + tail});
    segments.push_back({TokenKind::Text, q});
    s.layout = TokenLayout(segments);
    for (std::int32_t i = 0; i < text; ++i) s.keys.push_back(100000 * (1 + system) + i);
    for (std::int32_t i = 0; i < windows * bs_ + tail; ++i) s.keys.push_back(200000 + 1000 * video + i);
    for (std::int32_t i = 0; i < q; ++i) s.keys.push_back(300000 + 1000 * question + i);
    if (pick(6) == 0) s.keys.resize(static_cast<std::size_t>(pick(s.layout.num_tokens() + 1)));
    s.salt = mix64(static_cast<std::uint64_t>(id) * 7919 + ++created_);
    std::uint64_t h = 0;
    std::int32_t row = 0;
    for (const Segment& seg : s.layout.segments()) {
      for (std::int32_t i = 0; i < seg.length; ++i, ++row) {
        const auto r = static_cast<std::size_t>(row);
        const std::uint64_t key = r < s.keys.size() ? s.keys[r] : mix64(s.salt + r);
        h = mix64(h ^ mix64(key + (seg.kind == TokenKind::Visual ? 0x5555 : 0)));
        s.prefix.push_back(h);
      }
    }
    return s;
  }

  PrecisionPlan make_plan(const TokenLayout& layout) {
    const int family = pick(2);
    PrecisionPlan plan(layers_, layout.num_windows(bs_));
    for (std::int32_t l = 0; l < layers_; ++l) {
      for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
        const auto code = mix64(static_cast<std::uint64_t>(family * 131 + l * 17 + w)) % 3;
        plan.set(l, w, static_cast<Precision>(code));
      }
    }
    return plan;
  }

  SequenceId some_id(bool resident) {
    std::vector<SequenceId> ids;
    for (const auto& [id, s] : seqs_) {
      if (!resident || !cache_.is_swapped(id)) ids.push_back(id);
    }
    return ids.empty() ? -1 : ids[static_cast<std::size_t>(pick(static_cast<int>(ids.size())))];
  }

  bool add() {
    const SequenceId id = next_id_++;
    Seq s = make_prompt(id);
    const PrecisionPlan plan = make_plan(s.layout);
    const PrefixMatch probe = cache_.match_prefix(s.layout, plan, s.keys);
    const bool fits = cache_.can_allocate(probe.demand, probe);
    PrefixMatch m;
    try {
      m = cache_.add_sequence(id, s.layout, plan, s.keys);
    } catch (const OutOfMemory&) {
      EXPECT_FALSE(fits) << "can_allocate(demand, match) promised room";
      return false;
    }
    EXPECT_TRUE(fits) << "can_allocate(demand, match) promised no room";
    EXPECT_EQ(m.rows, probe.rows);
    EXPECT_EQ(m.plan, cache_.plan(id));
    hits += m.rows > 0 ? 1 : 0;
    // Rows below m.rows are served; the rest are computed and stored now.
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      const StoreMapping mapping = cache_.prefill_mapping(id, layer);
      for (std::int32_t r = m.rows; r < s.layout.num_tokens(); ++r) {
        const std::int32_t slot = mapping.fp16_slots[static_cast<std::size_t>(r)];
        if (slot >= 0) write_slot(slot, slot_tag(s, r, layer));
      }
      for (const Precision p : {Precision::INT4, Precision::INT2}) {
        for (const WindowSlot& w : p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows) {
          if (w.first_row >= m.rows) write_block(p, w.block_id, window_tag(s, w.first_row, layer, p));
        }
      }
    }
    seqs_[id] = std::move(s);
    return true;
  }

  void publish() {
    const SequenceId id = some_id(true);
    if (id < 0) return;
    const Seq& s = seqs_.at(id);
    const auto rows = static_cast<std::size_t>(pick(static_cast<int>(s.keys.size()) + 1));
    cache_.publish_prefix(id, std::span(s.keys).first(rows));
  }

  bool append() {
    std::vector<SequenceId> ids;
    for (const auto& [id, s] : seqs_) {
      if (!cache_.is_swapped(id) && pick(2) == 0) ids.push_back(id);
    }
    AppendResult r;
    try {
      r = cache_.append_tokens(ids);
    } catch (const OutOfMemory&) {
      return false;
    }
    for (const BlockCopy& c : r.copies) {
      for (std::int32_t o = 0; o < bs_; ++o) {
        const auto it = fp16_.find(c.src * bs_ + o);
        if (it != fp16_.end()) fp16_[c.dst * bs_ + o] = it->second;
      }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      Seq& s = seqs_.at(ids[i]);
      s.decode.push_back(mix64(s.salt + 1000003 * s.decode.size()));
      for (std::int32_t l = 0; l < layers_; ++l) {
        write_slot(r.slots[static_cast<std::size_t>(l)][i], decode_tag(s, s.decode.size() - 1, l));
      }
    }
    return true;
  }

  void fork() {
    const SequenceId parent = some_id(true);
    if (parent < 0) return;
    const SequenceId child = next_id_++;
    cache_.fork(parent, child);
    Seq s = seqs_.at(parent);
    s.salt = mix64(s.salt + 0x1234567 + static_cast<std::uint64_t>(child));
    seqs_[child] = std::move(s);
  }

  void free_one() {
    const SequenceId id = some_id(false);
    if (id < 0) return;
    cache_.free_sequence(id);
    seqs_.erase(id);
  }

  void truncate() {
    const SequenceId id = some_id(true);
    if (id < 0) return;
    Seq& s = seqs_.at(id);
    const auto keep = static_cast<std::size_t>(pick(static_cast<int>(s.decode.size()) + 1));
    cache_.truncate(id, s.layout.num_tokens() + static_cast<std::int32_t>(keep));
    s.decode.resize(keep);
  }

  bool swap() {
    const SequenceId id = some_id(false);
    if (id < 0) return false;
    try {
      const bool out = !cache_.is_swapped(id);
      const std::vector<SwapCopy> copies = out ? cache_.swap_out(id) : cache_.swap_in(id);
      for (const SwapCopy& c : copies) {
        const std::int32_t n = c.pool == Precision::FP16 ? bs_ : 1;
        for (std::int32_t o = 0; o < n; ++o) {
          const std::int64_t device = c.pool == Precision::FP16 ? c.device_block * bs_ + o : c.device_block;
          const std::int64_t host = std::int64_t{c.host_slot} * bs_ + o;
          auto& dev = c.pool == Precision::FP16 ? fp16_ : quant_[static_cast<std::size_t>(pool_index(c.pool))];
          auto& hst = host_[static_cast<std::size_t>(pool_index(c.pool))];
          if (out) {
            hst[host] = dev[static_cast<std::int32_t>(device)];
          } else {
            dev[static_cast<std::int32_t>(device)] = hst[host];
          }
        }
      }
    } catch (const OutOfMemory&) {
      return false;
    }
    return true;
  }

  void demote() {
    const SequenceId id = some_id(true);
    if (id < 0 || cache_.plan(id).num_windows() < 2) return;
    const Seq& s = seqs_.at(id);
    const std::int32_t layer = pick(layers_);
    const std::int32_t window = 1 + pick(cache_.plan(id).num_windows() - 1);
    const Precision target = pick(2) == 0 ? Precision::INT4 : Precision::INT2;
    if (cache_.why_not_demotable(id, layer, window, target)) return;
    std::vector<DemoteOp> ops;
    try {
      ops = cache_.demote(std::vector<Demotion>{{id, layer, window, target}});
    } catch (const OutOfMemory&) {
      return;
    }
    const std::int32_t first = s.layout.window_starts(bs_)[static_cast<std::size_t>(window)];
    write_block(target, ops.at(0).dst_block, window_tag(s, first, layer, target));
  }

  // Every resident sequence reads its own tags: prompt rows through its
  // prefill mapping, decode tokens through its page table.
  void verify() {
    for (const auto& [id, s] : seqs_) {
      if (cache_.is_swapped(id)) continue;
      const PrecisionPlan& plan = cache_.plan(id);
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        const StoreMapping mapping = cache_.prefill_mapping(id, layer);
        for (std::int32_t r = 0; r < s.layout.num_tokens(); ++r) {
          const std::int32_t slot = mapping.fp16_slots[static_cast<std::size_t>(r)];
          if (slot >= 0) {
            ASSERT_EQ(fp16_[slot], slot_tag(s, r, layer)) << "sequence " << id << " layer " << layer << " row " << r;
          }
        }
        for (const Precision p : {Precision::INT4, Precision::INT2}) {
          for (const WindowSlot& w : p == Precision::INT4 ? mapping.int4_windows : mapping.int2_windows) {
            ASSERT_EQ(quant_[static_cast<std::size_t>(pool_index(p))][w.block_id], window_tag(s, w.first_row, layer, p))
                << "sequence " << id << " layer " << layer << " window at row " << w.first_row;
          }
        }
        const auto windows = plan.window_counts(layer);
        const std::int64_t prompt_fp16 = s.layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs_;
        for (std::size_t k = 0; k < s.decode.size(); ++k) {
          const std::int32_t slot = cache_.page_table(id).fp16_slot(layer, prompt_fp16 + static_cast<std::int64_t>(k));
          ASSERT_EQ(fp16_[slot], decode_tag(s, k, layer)) << "sequence " << id << " decode token " << k;
        }
      }
    }
  }

  std::mt19937 rng_;
  KVCacheManager& cache_;
  std::int32_t bs_ = 0;
  std::int32_t layers_ = 0;
  SequenceId next_id_ = 1;
  std::uint64_t created_ = 0;
  std::map<SequenceId, Seq> seqs_;
  std::unordered_map<std::int32_t, std::uint64_t> fp16_;                  // FP16 slot -> tag
  std::array<std::unordered_map<std::int32_t, std::uint64_t>, 3> quant_;  // [pool] block -> tag
  std::array<std::unordered_map<std::int64_t, std::uint64_t>, 3> host_;   // [pool] host slot (x block) -> tag
};

TEST(PrefixCacheRandom, SharedBlocksHoldWhatTheSharerWouldCompute) {
  std::int64_t hits = 0, published = 0, evicted = 0;
  BlockCounts shared{};
  for (std::uint32_t seed = 1; seed <= 60; ++seed) {
    std::mt19937 rng(seed);
    CacheConfig c = tiny_config(1 + static_cast<std::int32_t>(rng() % 3), 4 + static_cast<std::int32_t>(rng() % 12));
    c.fp16_windows_first = rng() % 2 == 0;
    c.prefix_cache.enabled = true;
    c.prefix_cache.share_higher = rng() % 3 != 0;
    c.swap_blocks = {64, 64, 64};
    KVCacheManager cache(c);
    Harness h(seed, cache);
    h.run(250);
    ASSERT_FALSE(testing::Test::HasFailure()) << "seed " << seed;
    hits += h.hits;
    const PrefixCacheStats st = cache.prefix_stats();
    for (const Precision p : kAllPrecisions) {
      evicted += st.evicted[pool_index(p)];
      shared[pool_index(p)] += st.shared[pool_index(p)];
    }
    published += st.published;
  }
  std::printf("%lld hits sharing %lld FP16, %lld INT4, %lld INT2 blocks; %lld published, %lld evicted\n",
              static_cast<long long>(hits), static_cast<long long>(shared[0]), static_cast<long long>(shared[1]),
              static_cast<long long>(shared[2]), static_cast<long long>(published), static_cast<long long>(evicted));
  EXPECT_GT(hits, 100);
  EXPECT_GT(shared[1] + shared[2], 100);
  EXPECT_GT(evicted, 100);
}

}  // namespace
}  // namespace mixkv::test
