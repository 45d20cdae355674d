#pragma once
// A serving engine on the CPU backend for the scheduler tests: it applies a
// StepOutput the way step_output.h says (demotions, swap out, swap in,
// copy-on-write copies, then prefill stores and decode appends) on real
// bytes, runs decode attention over the step's metadata, and records every
// output. K/V/q values are a pure function of (request, position, layer,
// head, channel), so a request recomputed after preemption writes the same
// values again, and two runs of one workload can be compared output by output.
// A forked request (inherit()) takes its parent's values before the fork
// point, the tokens it shares, and its own after.
//
// It also holds the scheduler to its promises about bytes: a block swapped
// out comes back bit-identical (hash at swap_out == hash after swap_in).
// Decode tokens go to the slots of the compact form (per page-table slot,
// the FP16 tail of every layer, kept from tables_changed and
// append.tails_changed), which must equal append.slots when the step
// carries them (SchedulerConfig::per_layer_slots).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv::test {

inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// A value in [-1, 1) from a key: the same key always gives the same half.
inline Half value_of(std::uint64_t key) {
  const double u = static_cast<double>(mix(key) >> 11) / 9007199254740992.0;
  return float_to_half(static_cast<float>(2.0 * u - 1.0));
}

inline std::uint64_t key_of(RequestId id, std::int64_t position, std::int32_t layer, std::int32_t head,
                            std::int32_t channel, std::int32_t what) {
  std::uint64_t k = mix(static_cast<std::uint64_t>(id) * 0x9E3779B97F4A7C15ULL + 17);
  k = mix(k ^ static_cast<std::uint64_t>(position) * 0xBF58476D1CE4E5B9ULL);
  return k ^ (static_cast<std::uint64_t>(layer) << 40) ^ (static_cast<std::uint64_t>(head) << 32) ^
         (static_cast<std::uint64_t>(channel) << 8) ^ static_cast<std::uint64_t>(what);
}

inline std::uint64_t hash_bytes(const std::byte* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ std::to_integer<std::uint64_t>(p[i])) * 1099511628211ULL;
  return h;
}

class EngineSim {
 public:
  // q heads = 2 x KV heads (GQA 2:1).
  explicit EngineSim(const Scheduler& sched)
      : sched_(sched),
        cache_(sched.cache()),
        shape_(cache_.config().shape),
        arena_(cache_.config().arena_bytes),
        host_(std::max<std::size_t>(cache_.swap_bytes(), 1)),
        tails_(static_cast<std::size_t>(sched.config().max_num_seqs) * static_cast<std::size_t>(shape_.num_layers), -1) {
    for (const Precision p : kAllPrecisions) {
      pools_[pool_index(p)] = cache_.pool_view(p, arena_.data());
      host_pools_[pool_index(p)] = cache_.swap_view(p, host_.data());
    }
  }

  // Applies one step; `attention` runs decode attention for every layer
  // and records outputs (the metadata must have been built).
  void apply(const StepOutput& out, bool attention) {
    cpu::demote(out.demotions, pools_);
    demoted_ += static_cast<std::int64_t>(out.demotions.size());
    // Swap out: remember each block's bytes per (request, order in the list).
    std::size_t i = 0;
    for (const RequestId id : out.swapped_out) {
      const BlockCounts held = cache_.blocks_held(id);
      const auto n = static_cast<std::size_t>(held[0] + held[1] + held[2]);
      std::vector<std::uint64_t>& hashes = swapped_[id];
      hashes.clear();
      for (std::size_t k = 0; k < n; ++k, ++i) {
        const SwapCopy& c = out.swap_out[i];
        hashes.push_back(hash_bytes(pools_[pool_index(c.pool)].block(c.device_block), block_bytes(c.pool)));
      }
    }
    ASSERT_EQ(i, out.swap_out.size()) << "swap_out copies do not add up to the swapped requests' blocks";
    cpu::swap_blocks(out.swap_out, SwapDirection::DeviceToHost, pools_, host_pools_);
    cpu::swap_blocks(out.swap_in, SwapDirection::HostToDevice, pools_, host_pools_);
    i = 0;
    for (const RequestId id : out.swapped_in) {
      auto it = swapped_.find(id);
      ASSERT_NE(it, swapped_.end()) << "request " << id << " swapped in but never out";
      for (const std::uint64_t h : it->second) {
        const SwapCopy& c = out.swap_in[i++];
        ASSERT_EQ(hash_bytes(pools_[pool_index(c.pool)].block(c.device_block), block_bytes(c.pool)), h)
            << "request " << id << ": a block came back from the host pool changed";
        ++blocks_swapped_back_;
      }
      swapped_.erase(it);
    }
    ASSERT_EQ(i, out.swap_in.size());
    cpu::copy_blocks(out.append.copies, pools_[0]);

    const std::int32_t heads = shape_.num_kv_heads;
    const std::int32_t dim = shape_.head_dim;
    const std::size_t row = static_cast<std::size_t>(heads) * dim;
    for (const PrefillChunk& chunk : out.prefills) {
      const std::size_t rows = static_cast<std::size_t>(chunk.end - chunk.start);
      std::vector<Half> k(rows * row);
      std::vector<Half> v(rows * row);
      for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
        fill_rows(chunk.id, chunk.start, chunk.end, layer, k, v);
        cpu::store_prefill(k, v, chunk.mappings[static_cast<std::size_t>(layer)], pools_);
      }
      prefill_rows_ += static_cast<std::int64_t>(rows);
    }
    const std::size_t batch = out.decodes.size();
    const auto slots = compact_slots(out);
    if (testing::Test::HasFatalFailure() || batch == 0) return;
    std::vector<std::int64_t> positions(batch);
    for (std::size_t b = 0; b < batch; ++b) positions[b] = cache_.num_tokens(out.decodes[b]) - 1;
    std::vector<Half> k(batch * row);
    std::vector<Half> v(batch * row);
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (std::size_t b = 0; b < batch; ++b) {
        std::vector<Half> kr(row), vr(row);
        fill_rows(out.decodes[b], positions[b], positions[b] + 1, layer, kr, vr);
        std::copy(kr.begin(), kr.end(), k.begin() + static_cast<std::ptrdiff_t>(b * row));
        std::copy(vr.begin(), vr.end(), v.begin() + static_cast<std::ptrdiff_t>(b * row));
      }
      cpu::append(k, v, slots[static_cast<std::size_t>(layer)], pools_[0]);
    }
    if (!attention) return;
    const std::int32_t q_heads = 2 * heads;
    std::vector<RequestId> owners(batch);
    for (std::size_t b = 0; b < batch; ++b) owners[b] = source(out.decodes[b], positions[b]);
    std::vector<Half> q(batch * static_cast<std::size_t>(q_heads) * dim);
    std::vector<float> o(q.size());
    std::vector<float> lse(batch * static_cast<std::size_t>(q_heads));
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (std::size_t b = 0; b < batch; ++b) {
        for (std::int32_t h = 0; h < q_heads; ++h) {
          for (std::int32_t c = 0; c < dim; ++c) {
            q[(b * q_heads + h) * dim + c] = value_of(key_of(owners[b], positions[b], layer, h, c, 7));
          }
        }
      }
      cpu::DecodeAttentionArgs args;
      args.q = q;
      args.num_q_heads = q_heads;
      args.sm_scale = 1.0f / std::sqrt(static_cast<float>(dim));
      args.tables = &out.metadata.layers[static_cast<std::size_t>(layer)];
      args.pools = pools_;
      args.out = o;
      args.lse = lse;
      cpu::decode_attention(args);
      for (std::size_t b = 0; b < batch; ++b) {
        const auto first = o.begin() + static_cast<std::ptrdiff_t>(b * q_heads * dim);
        outputs_[{out.decodes[b], positions[b], layer}] = std::vector<float>(first, first + q_heads * dim);
      }
    }
  }

  // (request, position of the decode token, layer) -> attention output.
  const std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>>& outputs() const {
    return outputs_;
  }
  std::int64_t blocks_swapped_back() const { return blocks_swapped_back_; }
  std::int64_t prefill_rows() const { return prefill_rows_; }
  void forget(RequestId id) { swapped_.erase(id); }
  // `child` holds `parent`'s values at positions below `tokens`: call after
  // Scheduler::fork with the parent's token count (or to build a reference
  // request with the values a forked one has).
  void inherit(RequestId child, RequestId parent, std::int64_t tokens) { lineage_[child] = {parent, tokens}; }
  void inherit(RequestId child, RequestId parent) { inherit(child, parent, cache_.num_tokens(parent)); }

 private:
  std::size_t block_bytes(Precision p) const { return pools_[pool_index(p)].format.block_bytes(); }

  // [layer][i]: the decode slots from the compact form, after updating the
  // per-slot tails; equal to out.append.slots when the step has them.
  std::vector<std::vector<std::int32_t>> compact_slots(const StepOutput& out) {
    const auto layers = static_cast<std::size_t>(shape_.num_layers);
    const std::int32_t bs = shape_.block_size;
    for (const RequestId id : out.tables_changed) {
      // A request demoted and then preempted in the same step holds no slot.
      if (!sched_.contains(id) || sched_.status(id).slot < 0) continue;
      const auto tails = cache_.page_table(id).fp16_tails();
      std::copy(tails.begin(), tails.end(), tails_.begin() + static_cast<std::ptrdiff_t>(sched_.status(id).slot * layers));
    }
    const AppendResult& a = out.append;
    const std::size_t batch = out.decodes.size();
    EXPECT_EQ(a.offsets.size(), batch);
    EXPECT_EQ(a.tail_blocks.size(), a.tails_changed.size() * layers);
    if (a.offsets.size() != batch || a.tail_blocks.size() != a.tails_changed.size() * layers) {
      ADD_FAILURE() << "malformed compact slots";
      return {};
    }
    for (std::size_t k = 0; k < a.tails_changed.size(); ++k) {
      const auto slot = static_cast<std::size_t>(out.decode_slots[static_cast<std::size_t>(a.tails_changed[k])]);
      std::copy(a.tail_blocks.begin() + static_cast<std::ptrdiff_t>(k * layers),
                a.tail_blocks.begin() + static_cast<std::ptrdiff_t>((k + 1) * layers),
                tails_.begin() + static_cast<std::ptrdiff_t>(slot * layers));
    }
    std::vector<std::vector<std::int32_t>> slots(layers, std::vector<std::int32_t>(batch));
    for (std::size_t b = 0; b < batch; ++b) {
      const auto slot = static_cast<std::size_t>(out.decode_slots[b]);
      for (std::size_t l = 0; l < layers; ++l) slots[l][b] = tails_[slot * layers + l] * bs + a.offsets[b];
    }
    if (sched_.config().per_layer_slots) {
      EXPECT_EQ(slots, a.slots) << "step " << out.step << ": the compact slots differ from append.slots";
    } else {
      EXPECT_TRUE(a.slots.empty());
    }
    return slots;
  }

  void fill_rows(RequestId id, std::int64_t from, std::int64_t to, std::int32_t layer, std::vector<Half>& k,
                 std::vector<Half>& v) const {
    const std::int32_t heads = shape_.num_kv_heads;
    const std::int32_t dim = shape_.head_dim;
    std::size_t i = 0;
    for (std::int64_t pos = from; pos < to; ++pos) {
      const RequestId owner = source(id, pos);
      for (std::int32_t h = 0; h < heads; ++h) {
        for (std::int32_t c = 0; c < dim; ++c, ++i) {
          k[i] = value_of(key_of(owner, pos, layer, h, c, 1));
          v[i] = value_of(key_of(owner, pos, layer, h, c, 2));
        }
      }
    }
  }

  // Whose values `id` has at `position`: its own, or an ancestor's below a fork point.
  RequestId source(RequestId id, std::int64_t position) const {
    for (auto it = lineage_.find(id); it != lineage_.end() && position < it->second.second; it = lineage_.find(id)) {
      id = it->second.first;
    }
    return id;
  }

  const Scheduler& sched_;
  const KVCacheManager& cache_;
  std::map<RequestId, std::pair<RequestId, std::int64_t>> lineage_;  // child -> (parent, tokens at the fork)
  CacheShape shape_;
  std::vector<std::byte> arena_;
  std::vector<std::byte> host_;
  PoolViews pools_{};
  PoolViews host_pools_{};
  std::vector<std::int32_t> tails_;  // [page-table slot][layer]: FP16 tail block (compact slots)
  std::map<RequestId, std::vector<std::uint64_t>> swapped_;
  std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>> outputs_;
  std::int64_t demoted_ = 0;
  std::int64_t blocks_swapped_back_ = 0;
  std::int64_t prefill_rows_ = 0;
};

}  // namespace mixkv::test
