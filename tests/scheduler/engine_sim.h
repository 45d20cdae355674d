#pragma once
// A serving engine on the engine's CPU backend for the scheduler tests: it
// owns a CpuBackend and a Scheduler over the backend's manager, applies
// every StepOutput with Backend::apply, stores the prefill chunks' rows and
// attends the decode batch layer by layer, and records every output (FP16,
// as the backend writes it). K/V/q values are a pure function of (request,
// position, layer, head, channel), so a request recomputed after preemption
// writes the same values again, and two runs of one workload can be
// compared output by output. A forked request (inherit()) takes its
// parent's values before the fork point, the tokens it shares, and its own
// after.
//
// It also holds the scheduler to its promises about bytes, read through
// CpuBackend's pools: a block swapped out comes back bit-identical (hash at
// swap_out == hash after swap_in). The compact form of the decode slots
// (per page-table slot, the FP16 tail of every layer, kept from
// tables_changed and append.tail_blocks) must equal append.slots when the
// step carries them (SchedulerConfig::per_layer_slots), and the slots of the
// page tables, where the backend appends, when it does not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/core/hash.h"
#include "mixkv/engine/cpu_backend.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv::test {

// A value in [-1, 1) from a key: the same key always gives the same half.
inline Half value_of(std::uint64_t key) {
  const double u = static_cast<double>(mix64(key) >> 11) / 9007199254740992.0;
  return float_to_half(static_cast<float>(2.0 * u - 1.0));
}

inline std::uint64_t key_of(RequestId id, std::int64_t position, std::int32_t layer, std::int32_t head,
                            std::int32_t channel, std::int32_t what) {
  std::uint64_t k = mix64(static_cast<std::uint64_t>(id) * 0x9E3779B97F4A7C15ULL + 17);
  k = mix64(k ^ static_cast<std::uint64_t>(position) * 0xBF58476D1CE4E5B9ULL);
  return k ^ (static_cast<std::uint64_t>(layer) << 40) ^ (static_cast<std::uint64_t>(head) << 32) ^
         (static_cast<std::uint64_t>(channel) << 8) ^ static_cast<std::uint64_t>(what);
}

inline std::uint64_t hash_bytes(const std::byte* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ std::to_integer<std::uint64_t>(p[i])) * 1099511628211ULL;
  return h;
}

// A host array as the backend takes it (C-contiguous, on the CPU).
inline TensorView host_view(const void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = static_cast<std::int32_t>(shape.size());
  std::size_t i = 0;
  for (const std::int64_t d : shape) t.shape[i++] = d;
  return t;
}

// The CPU backend's config for a cache and a scheduler over it, q heads =
// 2 x KV heads (GQA 2:1).
inline BackendConfig backend_config(const CacheConfig& cache, const SchedulerConfig& config) {
  BackendConfig c;
  c.cache = cache;
  c.num_q_heads = 2 * cache.shape.num_kv_heads;
  c.max_num_seqs = config.max_num_seqs;
  c.max_prefill_rows = config.max_num_batched_tokens;
  return c;
}

class EngineSim {
 public:
  EngineSim(const CacheConfig& cache, const SchedulerConfig& config, std::shared_ptr<PlanSource> planner = nullptr)
      : backend_(CpuBackend::create(backend_config(cache, config))),
        cache_(backend_->manager()),
        sched_(backend_->manager(), config, std::move(planner)),
        shape_(cache.shape),
        tails_(static_cast<std::size_t>(config.max_num_seqs) * static_cast<std::size_t>(shape_.num_layers), -1) {}

  // The backend's manager and the scheduler that drives it.
  KVCacheManager& cache() { return backend_->manager(); }
  Scheduler& scheduler() { return sched_; }

  // Applies one step: its memory moves, then every layer's prefill rows and
  // decode tokens. `attention` records the decode outputs; attention runs
  // either way, since the backend appends a decode token as it attends.
  void apply(const StepOutput& out, bool attention) {
    demoted_ += static_cast<std::int64_t>(out.demotions.size());
    // A block is hashed as it leaves the device, after this step's
    // demotions (which may write it): those go first when both are present.
    const bool split = !out.demotions.empty() && !out.swap_out.empty();
    if (split) {
      StepOutput demotions;
      demotions.demotions = out.demotions;
      backend_->apply(demotions);
    }
    record_swapped_out(out);
    if (testing::Test::HasFatalFailure()) return;
    if (split) {
      StepOutput rest = out;
      rest.demotions.clear();
      backend_->apply(rest, sched_);
    } else {
      backend_->apply(out, sched_);
    }
    check_swapped_in(out);
    if (testing::Test::HasFatalFailure()) return;

    const std::int32_t heads = shape_.num_kv_heads;
    const std::int32_t dim = shape_.head_dim;
    const std::size_t row = static_cast<std::size_t>(heads) * dim;
    std::int64_t rows = 0;
    for (const PrefillChunk& chunk : out.prefills) rows += chunk.end - chunk.start;
    if (rows > 0) {
      std::vector<Half> k(static_cast<std::size_t>(rows) * row);
      std::vector<Half> v(k.size());
      for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
        std::size_t at = 0;
        for (const PrefillChunk& chunk : out.prefills) {
          fill_rows(chunk.id, chunk.start, chunk.end, layer, k.data() + at, v.data() + at);
          at += static_cast<std::size_t>(chunk.end - chunk.start) * row;
        }
        backend_->store(layer, host_view(k.data(), DType::F16, {rows, heads, dim}),
                        host_view(v.data(), DType::F16, {rows, heads, dim}));
      }
      prefill_rows_ += rows;
    }
    const std::size_t batch = out.decodes.size();
    check_compact_slots(out);
    if (testing::Test::HasFatalFailure() || batch == 0) return;
    const auto b64 = static_cast<std::int64_t>(batch);
    const std::int32_t q_heads = 2 * heads;
    std::vector<std::int64_t> positions(batch);
    std::vector<RequestId> owners(batch);
    for (std::size_t b = 0; b < batch; ++b) {
      positions[b] = cache_.num_tokens(out.decodes[b]) - 1;
      owners[b] = source(out.decodes[b], positions[b]);
    }
    std::vector<Half> k(batch * row);
    std::vector<Half> v(batch * row);
    std::vector<Half> q(batch * static_cast<std::size_t>(q_heads) * dim);
    std::vector<Half> o(q.size());
    std::vector<float> lse(batch * static_cast<std::size_t>(q_heads));
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (std::size_t b = 0; b < batch; ++b) {
        fill_rows(out.decodes[b], positions[b], positions[b] + 1, layer, k.data() + b * row, v.data() + b * row);
        for (std::int32_t h = 0; h < q_heads; ++h) {
          for (std::int32_t c = 0; c < dim; ++c) {
            q[(b * q_heads + h) * dim + c] = value_of(key_of(owners[b], positions[b], layer, h, c, 7));
          }
        }
      }
      const TensorView lse_view = host_view(lse.data(), DType::F32, {b64, q_heads});
      backend_->attend(layer, host_view(q.data(), DType::F16, {b64, q_heads, dim}),
                       host_view(k.data(), DType::F16, {b64, heads, dim}),
                       host_view(v.data(), DType::F16, {b64, heads, dim}),
                       host_view(o.data(), DType::F16, {b64, q_heads, dim}), &lse_view);
      if (!attention) continue;
      for (std::size_t b = 0; b < batch; ++b) {
        std::vector<float>& dst = outputs_[{out.decodes[b], positions[b], layer}];
        dst.resize(static_cast<std::size_t>(q_heads) * dim);
        for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = half_to_float(o[b * dst.size() + i]);
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
  std::uint64_t device_hash(Precision p, std::int32_t block) const {
    const PoolView view = backend_->arena_pools()[pool_index(p)];
    return hash_bytes(view.block(block), view.format.block_bytes());
  }

  // Each swapped-out block's device bytes, per (request, order in the list).
  void record_swapped_out(const StepOutput& out) {
    std::vector<std::size_t> blocks;
    std::size_t total = 0;
    for (const RequestId id : out.swapped_out) {
      const BlockCounts held = cache_.blocks_held(id);
      blocks.push_back(static_cast<std::size_t>(held[0] + held[1] + held[2]));
      total += blocks.back();
    }
    ASSERT_EQ(total, out.swap_out.size()) << "swap_out copies do not add up to the swapped requests' blocks";
    std::size_t i = 0;
    for (std::size_t r = 0; r < blocks.size(); ++r) {
      std::vector<std::uint64_t>& hashes = swapped_[out.swapped_out[r]];
      hashes.clear();
      for (std::size_t k = 0; k < blocks[r]; ++k, ++i) {
        hashes.push_back(device_hash(out.swap_out[i].pool, out.swap_out[i].device_block));
      }
    }
  }

  // Each swapped-in block's device bytes after the step's copies, which
  // write only blocks allocated after it, against its hash at swap out.
  void check_swapped_in(const StepOutput& out) {
    std::size_t i = 0;
    for (const RequestId id : out.swapped_in) {
      auto it = swapped_.find(id);
      ASSERT_NE(it, swapped_.end()) << "request " << id << " swapped in but never out";
      for (const std::uint64_t h : it->second) {
        ASSERT_LT(i, out.swap_in.size()) << "request " << id << ": fewer blocks swapped in than out";
        const SwapCopy& c = out.swap_in[i++];
        ASSERT_EQ(device_hash(c.pool, c.device_block), h)
            << "request " << id << ": a block came back from the host pool changed";
        ++blocks_swapped_back_;
      }
      swapped_.erase(it);
    }
    ASSERT_EQ(i, out.swap_in.size());
  }

  // The decode slots from the compact form, after updating the per-slot
  // tails: equal to out.append.slots when the step has them, else to the
  // page tables' FP16 tails at the same offsets (where the backend appends).
  void check_compact_slots(const StepOutput& out) {
    const auto layers = static_cast<std::size_t>(shape_.num_layers);
    const std::int32_t bs = shape_.block_size;
    for (const RequestId id : out.tables_changed) {
      // A request demoted and then preempted in the same step holds no slot.
      if (!sched_.contains(id) || sched_.status(id).slot < 0) continue;
      const auto tails = cache_.page_table(id).fp16_tails();
      std::copy(tails.begin(), tails.end(),
                tails_.begin() + static_cast<std::ptrdiff_t>(sched_.status(id).slot * layers));
    }
    const AppendResult& a = out.append;
    const std::size_t batch = out.decodes.size();
    EXPECT_EQ(a.offsets.size(), batch);
    EXPECT_EQ(a.tail_blocks.size(), a.tails_changed.size() * layers);
    if (a.offsets.size() != batch || a.tail_blocks.size() != a.tails_changed.size() * layers) {
      ADD_FAILURE() << "malformed compact slots";
      return;
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
      return;
    }
    EXPECT_TRUE(a.slots.empty());
    std::vector<std::vector<std::int32_t>> tables(layers, std::vector<std::int32_t>(batch));
    for (std::size_t b = 0; b < batch; ++b) {
      const auto tails = cache_.page_table(out.decodes[b]).fp16_tails();
      for (std::size_t l = 0; l < layers; ++l) tables[l][b] = tails[l] * bs + a.offsets[b];
    }
    EXPECT_EQ(slots, tables) << "step " << out.step << ": the compact slots differ from the page tables' tails";
  }

  // Rows [from, to) of `id`'s K and V at `layer`, [row][head][channel].
  void fill_rows(RequestId id, std::int64_t from, std::int64_t to, std::int32_t layer, Half* k, Half* v) const {
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

  // Declared in this order: the scheduler refers to the backend's manager.
  std::unique_ptr<CpuBackend> backend_;
  KVCacheManager& cache_;
  Scheduler sched_;
  std::map<RequestId, std::pair<RequestId, std::int64_t>> lineage_;  // child -> (parent, tokens at the fork)
  CacheShape shape_;
  std::vector<std::int32_t> tails_;  // [page-table slot][layer]: FP16 tail block (compact slots)
  std::map<RequestId, std::vector<std::uint64_t>> swapped_;
  std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::vector<float>> outputs_;
  std::int64_t demoted_ = 0;
  std::int64_t blocks_swapped_back_ = 0;
  std::int64_t prefill_rows_ = 0;
};

}  // namespace mixkv::test
