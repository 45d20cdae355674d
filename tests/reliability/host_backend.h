#pragma once
// The engine's CPU backend around one KVCacheManager, for the fault-injection
// tests (docs/reliability.md): the arena and the host swap buffer are real
// bytes, every K/V value is a pure function of (sequence, position, layer,
// head, channel), and each call drives the backend's manager directly
// (add_sequence, append_tokens, swap_out, swap_in, demote), then hands what
// the manager returned to Backend::apply as a one-call step and stores or
// attends the new rows. snapshot() reads a sequence's bytes back through
// CpuBackend's pools, from the device pools or, while it is swapped out,
// from its host slots, so a test can prove that a fault changed no other
// sequence's data.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../scheduler/engine_sim.h"  // value_of, key_of, host_view: the same K/V values as the scheduler tests
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/half.h"
#include "mixkv/engine/cpu_backend.h"

namespace mixkv::test {

class HostBackend {
 public:
  explicit HostBackend(const CacheConfig& config)
      : backend_(CpuBackend::create(backend_config(config))), shape_(config.shape) {}

  // The backend's manager: the one every call drives.
  KVCacheManager& cache() { return backend_->manager(); }
  const KVCacheManager& cache() const { return backend_->manager(); }

  // add_sequence, then the whole prompt stored in every layer.
  void add(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan) {
    cache().add_sequence(id, layout, plan);
    const std::int32_t rows = cache().num_tokens(id);
    StepOutput step;
    step.prefills.push_back({id, 0, 0, rows, true, {}});  // mappings from the manager
    backend_->apply(step);
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      std::vector<Half> k, v;
      fill(id, 0, rows, layer, k, v);
      backend_->store(layer, rows_view(k, rows), rows_view(v, rows));
    }
  }

  // append_tokens, then a decode step of `ids`: the copy-on-write copies,
  // then each new token's K/V in every layer (appended as the backend
  // attends; the output is not needed).
  AppendResult append(const std::vector<SequenceId>& ids) {
    std::vector<std::int64_t> positions;
    for (const SequenceId id : ids) positions.push_back(cache().contains(id) ? cache().num_tokens(id) : 0);
    AppendResult r = cache().append_tokens(ids);
    StepOutput step;
    step.decodes = ids;
    for (std::size_t i = 0; i < ids.size(); ++i) step.decode_slots.push_back(static_cast<std::int32_t>(i));
    step.append = r;
    backend_->apply(step);
    const auto batch = static_cast<std::int64_t>(ids.size());
    const std::int32_t heads = shape_.num_kv_heads;
    std::vector<Half> out(ids.size() * static_cast<std::size_t>(heads * shape_.head_dim));
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      std::vector<Half> k, v, q;
      for (std::size_t i = 0; i < ids.size(); ++i) {
        fill(ids[i], positions[i], positions[i] + 1, layer, k, v);
        values(ids[i], positions[i], positions[i] + 1, layer, 7, q);
      }
      backend_->attend(layer, rows_view(q, batch), rows_view(k, batch), rows_view(v, batch), rows_view(out, batch),
                       nullptr);
    }
    return r;
  }

  void swap_out(SequenceId id) {
    std::vector<SwapCopy> copies = cache().swap_out(id);
    StepOutput step;
    step.swap_out = copies;
    step.swapped_out = {id};
    backend_->apply(step);
    host_slots_[id] = std::move(copies);
  }

  void swap_in(SequenceId id) {
    StepOutput step;
    step.swap_in = cache().swap_in(id);
    step.swapped_in = {id};
    backend_->apply(step);
    host_slots_.erase(id);
  }

  std::vector<DemoteOp> demote(const std::vector<Demotion>& list) {
    StepOutput step;
    step.demotions = cache().demote(list);
    backend_->apply(step);
    return step.demotions;
  }

  void free(SequenceId id) {
    cache().free_sequence(id);
    host_slots_.erase(id);
  }

  // A sequence's bytes: every block of every layer and pool, whole, in
  // page-table order (its host slots, in the same order, while swapped out).
  std::vector<std::byte> snapshot(SequenceId id) const {
    std::vector<std::byte> out;
    auto put = [&out](const std::byte* p, std::size_t n) { out.insert(out.end(), p, p + n); };
    if (cache().is_swapped(id)) {
      const PoolViews host = backend_->swap_pools();
      for (const SwapCopy& c : host_slots_.at(id)) {
        const PoolView& view = host[pool_index(c.pool)];
        put(view.block(c.host_slot), view.format.block_bytes());
      }
      return out;
    }
    const PoolViews pools = backend_->arena_pools();
    for (std::int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (const Precision p : kAllPrecisions) {
        const PoolView& view = pools[pool_index(p)];
        for (const std::int32_t b : cache().blocks(id, layer, p)) put(view.block(b), view.format.block_bytes());
      }
    }
    return out;
  }

  // One device block's bytes.
  const std::byte* block(Precision p, std::int32_t id) const {
    return backend_->arena_pools()[pool_index(p)].block(id);
  }

  std::map<SequenceId, std::vector<std::byte>> snapshot_all() const {
    std::map<SequenceId, std::vector<std::byte>> all;
    for (const SequenceId id : cache().sequence_ids()) all[id] = snapshot(id);
    return all;
  }

  // The values a sequence's prompt row or decode token `position` has.
  void fill(SequenceId id, std::int64_t from, std::int64_t to, std::int32_t layer, std::vector<Half>& k,
            std::vector<Half>& v) const {
    values(id, from, to, layer, 1, k);
    values(id, from, to, layer, 2, v);
  }

 private:
  // q heads = KV heads: attention runs only to append, its output is unused.
  static BackendConfig backend_config(const CacheConfig& config) {
    BackendConfig c;
    c.cache = config;
    c.num_q_heads = config.shape.num_kv_heads;
    c.max_num_seqs = 1 << 12;  // every sequence a test holds, in one batch
    return c;
  }

  TensorView rows_view(const std::vector<Half>& data, std::int64_t rows) const {
    return host_view(data.data(), DType::F16, {rows, shape_.num_kv_heads, shape_.head_dim});
  }

  // Rows [from, to) of K (what = 1), V (2) or q (7), appended to `out`.
  void values(SequenceId id, std::int64_t from, std::int64_t to, std::int32_t layer, int what,
              std::vector<Half>& out) const {
    for (std::int64_t pos = from; pos < to; ++pos) {
      for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
        for (std::int32_t c = 0; c < shape_.head_dim; ++c) out.push_back(value_of(key_of(id, pos, layer, h, c, what)));
      }
    }
  }

  std::unique_ptr<CpuBackend> backend_;
  CacheShape shape_;
  std::map<SequenceId, std::vector<SwapCopy>> host_slots_;
};

}  // namespace mixkv::test
