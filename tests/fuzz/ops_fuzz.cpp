// libFuzzer target over the CPU ops (docs/reliability.md): a small cache
// (manager, a host arena of exactly total_slabs * slab_bytes bytes and a
// swap buffer of exactly swap_bytes(), so AddressSanitizer sees one byte
// past either), then up to 64 calls: the manager's add, append, swap,
// demote and free to make real mappings, slots, copies and page tables, and
// the ops store_prefill, append, copy_blocks, swap_blocks, demote and
// decode_attention on them, each list mutated at times with ids one past the
// end, far past it, negative or at the int32 limits, and NaN planted in the
// arena. Every op either returns or throws a typed error; a failed op writes
// no byte of the arena or the swap buffer; no op changes the manager
// (describe_state() equal, check_invariants() passing); an op built from
// the manager's own output without mutation, on finite data, succeeds.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/half.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"

namespace mixkv::fuzz {
namespace {

constexpr int kMaxCalls = 64;

CacheConfig decode_config(FuzzedDataProvider& in) { return decode_cache_config(in, ConfigRanges{}); }

class Harness {
 public:
  Harness(FuzzedDataProvider& in, KVCacheManager& cache) : in_(in), cache_(cache) {
    const CacheShape& s = cache.config().shape;
    bs_ = s.block_size;
    heads_ = s.num_kv_heads;
    dim_ = s.head_dim;
    layers_ = s.num_layers;
    // Exactly the bytes the pools address: one past them is outside the allocation.
    arena_.resize(static_cast<std::size_t>(cache.total_slabs()) * cache.config().slab_bytes);
    swap_.resize(std::max<std::size_t>(cache.swap_bytes(), 1));
    for (Precision p : kAllPrecisions) {
      pools_[pool_index(p)] = cache.pool_view(p, arena_.data());
      host_[pool_index(p)] = cache.swap_view(p, swap_.data());
    }
  }

  void run() {
    for (int call = 0; call < kMaxCalls && in_.remaining_bytes() > 0; ++call) {
      switch (in_.ConsumeIntegralInRange<int>(0, 11)) {
        case 0:
        case 1: add(); break;
        case 2: store(); break;
        case 3: append(); break;
        case 4: copy(); break;
        case 5: swap(); break;
        case 6: demote(); break;
        case 7:
        case 8: decode(); break;
        case 9: plant(); break;
        case 10: free_one(); break;
        default: random_ops(); break;
      }
    }
    for (SequenceId id : cache_.sequence_ids()) cache_.free_sequence(id);
    cache_.check_invariants();
  }

 private:
  // An id near `limit` or anywhere: in range, at either end, one past the
  // end, far past it, negative, the int32 extremes.
  std::int32_t pick_id(std::int64_t limit) {
    const auto top = static_cast<std::int32_t>(std::clamp<std::int64_t>(limit, 0, INT32_MAX));
    switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: return top;
      case 1: return top == INT32_MAX ? top : top + 1;
      case 2: return -1;
      case 3: return -2;
      case 4: return std::numeric_limits<std::int32_t>::max();
      case 5: return std::numeric_limits<std::int32_t>::min();
      case 6: return in_.ConsumeIntegral<std::int32_t>();
      case 7: return top > 0 ? top - 1 : 0;
      default: return top > 0 ? in_.ConsumeIntegralInRange<std::int32_t>(0, top - 1) : 0;
    }
  }
  bool mutate() { return in_.ConsumeIntegralInRange<int>(0, 3) == 0; }

  std::vector<Half> halves(std::size_t n) {
    std::vector<Half> out(n);
    const std::uint16_t seed = in_.ConsumeIntegral<std::uint16_t>();
    for (std::size_t i = 0; i < n; ++i)
      out[i] = float_to_half(static_cast<float>((seed + 37 * i) % 201) / 25.0f - 4.0f);
    if (!out.empty() && in_.ConsumeIntegralInRange<int>(0, 15) == 0) {
      out[in_.ConsumeIntegralInRange<std::size_t>(0, n - 1)] =
          Half{in_.ConsumeBool() ? std::uint16_t{0x7e00} : std::uint16_t{0xfc00}};
    }
    return out;
  }
  static bool finite(std::span<const Half> values) {
    return std::all_of(values.begin(), values.end(), [](Half h) { return (h.bits & 0x7c00u) != 0x7c00u; });
  }

  // Runs an op: typed errors only; a failure writes no byte; the manager is
  // never changed by an op. `must_succeed`: built from the manager's own
  // output on finite data.
  template <class F>
  void op(const char* what, bool must_succeed, F&& call) {
    const std::string state = cache_.describe_state();
    const std::vector<std::byte> arena = arena_;
    const std::vector<std::byte> swap = swap_;
    const Outcome outcome = attempt(what, call);
    if (outcome != Outcome::Ok) {
      if (arena != arena_) finding(std::string(what) + " failed but wrote the arena");
      if (swap != swap_) finding(std::string(what) + " failed but wrote the swap buffer");
      if (must_succeed) finding(std::string(what) + " refused input made by the manager");
    }
    check_consistency(cache_, state, true);
  }
  // Runs a manager call: typed errors only, and a failure changes nothing.
  template <class F>
  bool manage(const char* what, F&& call) {
    const std::string state = cache_.describe_state();
    const bool ok = attempt(what, call) == Outcome::Ok;
    check_consistency(cache_, state, !ok);
    return ok;
  }

  std::vector<SequenceId> resident() {
    std::vector<SequenceId> ids;
    for (SequenceId id : cache_.sequence_ids()) {
      if (!cache_.is_swapped(id)) ids.push_back(id);
    }
    return ids;
  }
  std::optional<SequenceId> pick_sequence(bool resident_only) {
    const std::vector<SequenceId> ids = resident_only ? resident() : cache_.sequence_ids();
    if (ids.empty()) return std::nullopt;
    return ids[in_.ConsumeIntegralInRange<std::size_t>(0, ids.size() - 1)];
  }

  void add() {
    const std::int32_t text = in_.ConsumeIntegralInRange<std::int32_t>(1, 40);
    const std::int32_t visual = in_.ConsumeIntegralInRange<std::int32_t>(0, 3 * bs_);
    std::vector<Segment> segments = {{TokenKind::Text, text}};
    if (visual > 0) segments.push_back({TokenKind::Visual, visual});
    const TokenLayout layout(segments);
    PrecisionPlan plan(layers_, layout.num_windows(bs_));
    for (std::int32_t l = 0; l < layers_; ++l) {
      for (std::int32_t w = 1; w < plan.num_windows(); ++w)
        plan.set(l, w, kAllPrecisions[in_.ConsumeIntegralInRange<int>(0, 2)]);
    }
    manage("add_sequence", [&] { cache_.add_sequence(next_id_, layout, plan); });
    ++next_id_;
  }

  void store() {
    const auto id = pick_sequence(true);
    if (!id) return;
    const std::int32_t layer = in_.ConsumeIntegralInRange<std::int32_t>(0, layers_ - 1);
    StoreMapping m = cache_.prefill_mapping(*id, layer);
    bool mutated = false;
    if (mutate() && !m.fp16_slots.empty()) {
      m.fp16_slots[in_.ConsumeIntegralInRange<std::size_t>(0, m.fp16_slots.size() - 1)] =
          pick_id(static_cast<std::int64_t>(pools_[0].num_blocks) * bs_);
      mutated = true;
    }
    for (auto* windows : {&m.int4_windows, &m.int2_windows}) {
      if (mutate() && !windows->empty()) {
        const Precision p = windows == &m.int4_windows ? Precision::INT4 : Precision::INT2;
        auto& w = (*windows)[in_.ConsumeIntegralInRange<std::size_t>(0, windows->size() - 1)];
        if (in_.ConsumeBool()) {
          w.block_id = pick_id(pools_[pool_index(p)].num_blocks);
        } else {
          w.first_row = pick_id(static_cast<std::int64_t>(m.fp16_slots.size()));
        }
        mutated = true;
      }
    }
    const std::size_t n = m.fp16_slots.size() * static_cast<std::size_t>(heads_) * dim_;
    const std::vector<Half> k = halves(n);
    const std::vector<Half> v = halves(n);
    op("store_prefill", !mutated && finite(k) && finite(v), [&] { cpu::store_prefill(k, v, m, pools_); });
  }

  void append() {
    std::vector<SequenceId> ids = resident();
    if (ids.empty()) return;
    ids.resize(in_.ConsumeIntegralInRange<std::size_t>(1, ids.size()));
    AppendResult r;
    if (!manage("append_tokens", [&] { r = cache_.append_tokens(ids); })) return;
    if (!r.copies.empty()) op("copy_blocks (append)", true, [&] { cpu::copy_blocks(r.copies, pools_[0]); });
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      std::vector<std::int32_t> slots = r.slots[layer];
      bool mutated = false;
      if (mutate()) {
        slots[in_.ConsumeIntegralInRange<std::size_t>(0, slots.size() - 1)] =
            pick_id(static_cast<std::int64_t>(pools_[0].num_blocks) * bs_);
        mutated = true;
      }
      if (in_.ConsumeBool()) slots.push_back(-1);  // a padding row
      const std::size_t n = slots.size() * static_cast<std::size_t>(heads_) * dim_;
      std::vector<Half> k = halves(n);
      std::vector<Half> v = halves(n);
      if (!slots.empty() && slots.back() == -1) {
        k[n - 1] = Half{0x7e00};  // padding rows may hold anything
      }
      bool finite_rows = true;  // of the rows that are written
      const std::size_t row = static_cast<std::size_t>(heads_) * dim_;
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] == -1) continue;
        finite_rows =
            finite_rows && finite(std::span(k).subspan(i * row, row)) && finite(std::span(v).subspan(i * row, row));
      }
      op("append", !mutated && finite_rows, [&] { cpu::append(k, v, slots, pools_[0]); });
    }
  }

  void copy() {
    const auto p = kAllPrecisions[in_.ConsumeIntegralInRange<int>(0, 2)];
    std::vector<BlockCopy> copies(in_.ConsumeIntegralInRange<std::size_t>(0, 4));
    for (BlockCopy& c : copies) {
      c.src = pick_id(pools_[pool_index(p)].num_blocks);
      c.dst = pick_id(pools_[pool_index(p)].num_blocks);
    }
    op("copy_blocks", false, [&] { cpu::copy_blocks(copies, pools_[pool_index(p)]); });
  }

  void swap() {
    const auto id = pick_sequence(false);
    if (!id) return;
    const bool out = !cache_.is_swapped(*id);
    std::vector<SwapCopy> copies;
    if (!manage(out ? "swap_out" : "swap_in", [&] { copies = out ? cache_.swap_out(*id) : cache_.swap_in(*id); }))
      return;
    bool mutated = false;
    if (mutate() && !copies.empty()) {
      SwapCopy& c = copies[in_.ConsumeIntegralInRange<std::size_t>(0, copies.size() - 1)];
      if (in_.ConsumeBool()) {
        c.device_block = pick_id(pools_[pool_index(c.pool)].num_blocks);
      } else {
        c.host_slot = pick_id(host_[pool_index(c.pool)].num_blocks);
      }
      mutated = true;
    }
    const SwapDirection d = out ? SwapDirection::DeviceToHost : SwapDirection::HostToDevice;
    op("swap_blocks", !mutated, [&] { cpu::swap_blocks(copies, d, pools_, host_); });
  }

  void demote() {
    const auto id = pick_sequence(true);
    if (!id) return;
    const PrecisionPlan plan = cache_.plan(*id);
    if (plan.num_windows() < 2) return;
    const Demotion d{*id, in_.ConsumeIntegralInRange<std::int32_t>(0, layers_ - 1),
                     in_.ConsumeIntegralInRange<std::int32_t>(1, plan.num_windows() - 1),
                     in_.ConsumeBool() ? Precision::INT4 : Precision::INT2};
    std::vector<DemoteOp> ops;
    if (!manage("demote (manager)", [&] { ops = cache_.demote(std::span(&d, 1)); })) return;
    bool mutated = false;
    if (mutate() && !ops.empty()) {
      DemoteOp& o = ops[0];
      if (in_.ConsumeBool()) {
        o.src_block = pick_id(pools_[pool_index(o.src_precision)].num_blocks);
      } else {
        o.dst_block = pick_id(pools_[pool_index(o.dst_precision)].num_blocks);
      }
      mutated = true;
    }
    // A source block never written holds zeros; one with a planted NaN is refused.
    op("demote", !mutated && !planted_, [&] { cpu::demote(ops, pools_); });
  }

  void decode() {
    std::vector<SequenceId> ids = resident();
    if (ids.empty()) return;
    ids.resize(in_.ConsumeIntegralInRange<std::size_t>(1, ids.size()));
    DecodeMetadata md;
    if (!manage("decode_metadata", [&] { md = cache_.decode_metadata(ids); })) return;
    auto tables = md.layers[in_.ConsumeIntegralInRange<std::size_t>(0, md.layers.size() - 1)];
    bool mutated = false;
    if (mutate()) {
      const int p = in_.ConsumeIntegralInRange<int>(0, 2);
      PagedPoolTable& t = tables[p];
      switch (in_.ConsumeIntegralInRange<int>(0, 2)) {
        case 0:
          if (!t.indices.empty())
            t.indices[in_.ConsumeIntegralInRange<std::size_t>(0, t.indices.size() - 1)] = pick_id(pools_[p].num_blocks);
          break;
        case 1:
          t.last_block_len[in_.ConsumeIntegralInRange<std::size_t>(0, t.last_block_len.size() - 1)] = pick_id(bs_ + 1);
          break;
        default:
          t.indptr[in_.ConsumeIntegralInRange<std::size_t>(0, t.indptr.size() - 1)] =
              pick_id(static_cast<std::int64_t>(t.indices.size()) + 1);
          break;
      }
      mutated = true;
    }
    const std::int32_t group = in_.ConsumeIntegralInRange<std::int32_t>(1, 2);
    const std::size_t batch = ids.size();
    const std::vector<Half> q = halves(batch * heads_ * group * dim_);
    // out and lse in one buffer, disjoint or (at times) overlapping.
    std::vector<float> memory(batch * heads_ * group * (dim_ + 1));
    const std::size_t out_n = batch * heads_ * group * dim_;
    const std::size_t lse_at =
        in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? in_.ConsumeIntegralInRange<std::size_t>(0, out_n) : out_n;
    cpu::DecodeAttentionArgs args;
    args.q = q;
    args.num_q_heads = heads_ * group;
    args.sm_scale = 0.25f;
    args.tables = &tables;
    args.pools = pools_;
    args.out = std::span(memory).first(out_n);
    args.lse = std::span(memory).subspan(lse_at, batch * heads_ * group);
    op("decode_attention", !mutated && finite(q) && lse_at == out_n, [&] { cpu::decode_attention(args); });
  }

  // NaN or inf bytes written into the arena (through the view, as a user could).
  void plant() {
    if (arena_.size() < 2) return;
    const std::size_t at = in_.ConsumeIntegralInRange<std::size_t>(0, arena_.size() / 2 - 1) * 2;
    const std::uint16_t bits = in_.ConsumeBool() ? 0x7e00 : 0x7c00;
    std::memcpy(arena_.data() + at, &bits, sizeof bits);
    planted_ = true;
  }

  void free_one() {
    const auto id = pick_sequence(false);
    if (id) manage("free_sequence", [&] { cache_.free_sequence(*id); });
  }

  // Lists made up from nothing: swaps and demotions of any ids.
  void random_ops() {
    std::vector<SwapCopy> swaps(in_.ConsumeIntegralInRange<std::size_t>(0, 3));
    for (SwapCopy& c : swaps) {
      c.pool = kAllPrecisions[in_.ConsumeIntegralInRange<int>(0, 2)];
      c.device_block = pick_id(pools_[pool_index(c.pool)].num_blocks);
      c.host_slot = pick_id(host_[pool_index(c.pool)].num_blocks);
    }
    const SwapDirection d = in_.ConsumeBool() ? SwapDirection::DeviceToHost : SwapDirection::HostToDevice;
    op("swap_blocks (made up)", false, [&] { cpu::swap_blocks(swaps, d, pools_, host_); });
    std::vector<DemoteOp> ops(in_.ConsumeIntegralInRange<std::size_t>(0, 3));
    for (DemoteOp& o : ops) {
      o.src_precision = in_.ConsumeBool() ? Precision::FP16 : Precision::INT4;
      o.dst_precision = o.src_precision == Precision::INT4 || in_.ConsumeBool() ? Precision::INT2 : Precision::INT4;
      o.src_block = pick_id(pools_[pool_index(o.src_precision)].num_blocks);
      o.dst_block = pick_id(pools_[pool_index(o.dst_precision)].num_blocks);
    }
    op("demote (made up)", false, [&] { cpu::demote(ops, pools_); });
  }

  FuzzedDataProvider& in_;
  KVCacheManager& cache_;
  std::int32_t bs_ = 0, heads_ = 0, dim_ = 0, layers_ = 0;
  std::vector<std::byte> arena_;
  std::vector<std::byte> swap_;
  PoolViews pools_{};
  PoolViews host_{};
  SequenceId next_id_ = 1;
  bool planted_ = false;
};

}  // namespace
}  // namespace mixkv::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::atexit(mixkv::fuzz::print_counters);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return mixkv::fuzz::run_cache_input<mixkv::fuzz::Harness>(data, size, mixkv::fuzz::decode_config);
}
