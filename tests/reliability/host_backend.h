#pragma once
// The CPU backend around one KVCacheManager, for the fault-injection tests
// (docs/reliability.md): the arena and the host swap buffer are real bytes,
// every K/V value is a pure function of (sequence, position, layer, head,
// channel), and each call applies what the manager hands out (prefill
// mappings, append slots and copy-on-write copies, swap copies, demote ops)
// with the CPU ops. snapshot() reads a sequence's bytes back, from the
// device pools or, while it is swapped out, from its host slots, so a test
// can prove that a fault changed no other sequence's data.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"
#include "../scheduler/engine_sim.h"  // value_of, key_of: the same K/V values as the scheduler tests

namespace mixkv::test {

class HostBackend {
 public:
  explicit HostBackend(KVCacheManager& cache)
      : cache_(cache),
        shape_(cache.config().shape),
        arena_(cache.config().arena_bytes),
        host_(std::max<std::size_t>(cache.swap_bytes(), 1)) {
    for (const Precision p : kAllPrecisions) {
      pools_[pool_index(p)] = cache.pool_view(p, arena_.data());
      host_pools_[pool_index(p)] = cache.swap_view(p, host_.data());
    }
  }

  KVCacheManager& cache() { return cache_; }

  // add_sequence, then store_prefill of every layer.
  void add(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan) {
    cache_.add_sequence(id, layout, plan);
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      const StoreMapping m = cache_.prefill_mapping(id, layer);
      const auto rows = static_cast<std::int64_t>(m.fp16_slots.size());
      std::vector<Half> k, v;
      fill(id, 0, rows, layer, k, v);
      cpu::store_prefill(k, v, m, pools_);
    }
  }

  // append_tokens, the copy-on-write copies, then each new token's K/V.
  AppendResult append(const std::vector<SequenceId>& ids) {
    std::vector<std::int64_t> positions;
    for (const SequenceId id : ids) positions.push_back(cache_.contains(id) ? cache_.num_tokens(id) : 0);
    AppendResult r = cache_.append_tokens(ids);
    cpu::copy_blocks(r.copies, pools_[0]);
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      std::vector<Half> k, v;
      for (std::size_t i = 0; i < ids.size(); ++i) fill(ids[i], positions[i], positions[i] + 1, layer, k, v);
      cpu::append(k, v, r.slots[static_cast<std::size_t>(layer)], pools_[0]);
    }
    return r;
  }

  void swap_out(SequenceId id) {
    std::vector<SwapCopy> copies = cache_.swap_out(id);
    cpu::swap_blocks(copies, SwapDirection::DeviceToHost, pools_, host_pools_);
    host_slots_[id] = std::move(copies);
  }

  void swap_in(SequenceId id) {
    const std::vector<SwapCopy> copies = cache_.swap_in(id);
    cpu::swap_blocks(copies, SwapDirection::HostToDevice, pools_, host_pools_);
    host_slots_.erase(id);
  }

  std::vector<DemoteOp> demote(const std::vector<Demotion>& list) {
    std::vector<DemoteOp> ops = cache_.demote(list);
    cpu::demote(ops, pools_);
    return ops;
  }

  void free(SequenceId id) {
    cache_.free_sequence(id);
    host_slots_.erase(id);
  }

  // A sequence's bytes: every block of every layer and pool, whole, in
  // page-table order (its host slots, in the same order, while swapped out).
  std::vector<std::byte> snapshot(SequenceId id) const {
    std::vector<std::byte> out;
    auto put = [&out](const std::byte* p, std::size_t n) { out.insert(out.end(), p, p + n); };
    if (cache_.is_swapped(id)) {
      for (const SwapCopy& c : host_slots_.at(id)) {
        const PoolView& view = host_pools_[pool_index(c.pool)];
        put(view.block(c.host_slot), view.format.block_bytes());
      }
      return out;
    }
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (const Precision p : kAllPrecisions) {
        const PoolView& view = pools_[pool_index(p)];
        for (const std::int32_t b : cache_.blocks(id, layer, p)) put(view.block(b), view.format.block_bytes());
      }
    }
    return out;
  }

  // One device block's bytes.
  const std::byte* block(Precision p, std::int32_t id) const { return pools_[pool_index(p)].block(id); }

  std::map<SequenceId, std::vector<std::byte>> snapshot_all() const {
    std::map<SequenceId, std::vector<std::byte>> all;
    for (const SequenceId id : cache_.sequence_ids()) all[id] = snapshot(id);
    return all;
  }

  // The values a sequence's prompt row or decode token `position` has.
  void fill(SequenceId id, std::int64_t from, std::int64_t to, std::int32_t layer, std::vector<Half>& k,
            std::vector<Half>& v) const {
    for (std::int64_t pos = from; pos < to; ++pos) {
      for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
        for (std::int32_t c = 0; c < shape_.head_dim; ++c) {
          k.push_back(value(id, pos, layer, h, c, 1));
          v.push_back(value(id, pos, layer, h, c, 2));
        }
      }
    }
  }

 private:
  static Half value(SequenceId id, std::int64_t pos, std::int32_t layer, std::int32_t head, std::int32_t channel,
                    int what) {
    return value_of(key_of(id, pos, layer, head, channel, what));
  }

  KVCacheManager& cache_;
  CacheShape shape_;
  std::vector<std::byte> arena_;
  std::vector<std::byte> host_;
  PoolViews pools_{};
  PoolViews host_pools_{};
  std::map<SequenceId, std::vector<SwapCopy>> host_slots_;
};

}  // namespace mixkv::test
