// libFuzzer target: sequences of KVCacheManager calls (docs/reliability.md).
//
// The first bytes choose a small configuration (1-3 layers, 1-2 KV heads,
// head_dim 16 or 32, block_size 16 or 32, 1-8 slabs of 1-4 FP16 blocks, a
// host swap pool of 0-12 slots per pool, either FP16 packing; sometimes a
// malformed one), the rest up to 200 calls, valid and invalid, with ids from
// a small range so that they collide: add_sequence, append_tokens (by id and
// by handle, per-layer and compact slots; several tokens a sequence),
// truncate, fork, free_sequence, swap_out, swap_in, demote,
// decode_metadata, prefill_mapping and the inspection calls; with prefix
// caching on (sometimes), add_sequence with content keys drawn from a few
// prompts (a hit stores only the rows after the cached prefix),
// publish_prefix and evict_prefix_cache.
//
// Checked after every call: check_invariants(); the call returned or threw a
// typed error (errors.h), and a throwing or const call left describe_state()
// unchanged; can_allocate() predicted add_sequence, swap_in and demote
// exactly; every resident sequence's blocks hold exactly its tokens, and
// every prefill mapping points at them (Shadow, fuzz_support.h). At the end,
// freeing every sequence gives back every block and host slot.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv::fuzz {
namespace {

constexpr int kMaxCalls = 200;
constexpr SequenceId kMaxId = 8;  // ids in [-1, 8]: repeats, unknown and negative ids

struct Live {
  std::vector<Tag> tokens;  // per position
  SequenceHandle handle;
  std::vector<TokenKey> keys;  // content keys of its first prompt rows
};

CacheConfig decode_config(FuzzedDataProvider& in) {
  CacheConfig c = decode_cache_config(
      in,
      ConfigRanges{
          .max_layers = 3, .max_blocks_per_slab = 4, .max_slab_padding = 300, .max_slabs = 8, .max_swap_slots = 12});
  const std::size_t fp16_block = static_cast<std::size_t>(c.shape.num_kv_heads) * c.shape.head_dim *
                                 static_cast<std::size_t>(c.shape.block_size) * 2 * sizeof(std::uint16_t);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    // Malformed on purpose: the constructor must throw a typed error or build
    // a working manager, nothing else.
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 0: c.shape.head_dim = in.ConsumeIntegralInRange<std::int32_t>(-16, 600); break;
      case 1: c.shape.block_size = in.ConsumeIntegralInRange<std::int32_t>(-16, 300); break;
      case 2: c.slab_bytes = in.ConsumeIntegralInRange<std::size_t>(0, 2 * fp16_block); break;
      case 3: c.arena_bytes = in.ConsumeIntegralInRange<std::size_t>(0, 2 * c.slab_bytes); break;
      default: c.swap_blocks[in.ConsumeIntegralInRange<std::size_t>(0, 2)] = in.ConsumeIntegral<std::int64_t>(); break;
    }
  }
  c.prefix_cache.enabled = in.ConsumeBool();
  c.prefix_cache.share_higher = in.ConsumeBool();
  return c;
}

class Harness {
 public:
  Harness(FuzzedDataProvider& in, KVCacheManager& cache) : in_(in), cache_(cache), shadow_(cache) {
    bs_ = cache.config().shape.block_size;
    layers_ = cache.config().shape.num_layers;
  }

  void run() {
    for (int call = 0; call < kMaxCalls && in_.remaining_bytes() > 0; ++call) {
      const std::string before = cache_.describe_state();
      bool unchanged = false;  // the state must equal `before` afterwards
      switch (in_.ConsumeIntegralInRange<int>(0, 14)) {
        case 0:
        case 1: unchanged = !add(); break;
        case 2: unchanged = !append(/*by_handle=*/false); break;
        case 3: unchanged = !append(/*by_handle=*/true); break;
        case 4: unchanged = !fork(); break;
        case 5: unchanged = !free_one(); break;
        case 6: unchanged = !swap_out(); break;
        case 7: unchanged = !swap_in(); break;
        case 8: unchanged = !demote(); break;
        case 9:
          metadata();
          unchanged = true;
          break;
        case 10:
          mapping();
          unchanged = true;
          break;
        case 11: unchanged = !append_rows(); break;
        case 12: unchanged = !truncate(); break;
        case 13: unchanged = !prefix(); break;
        default:
          inspect();
          unchanged = true;
          break;
      }
      check_all(before, unchanged);
    }
    drain();
  }

 private:
  // --- inputs
  SequenceId any_id() { return in_.ConsumeIntegralInRange<SequenceId>(-1, kMaxId); }
  // Mostly a live sequence, sometimes any id.
  SequenceId some_id() {
    if (live_.empty() || in_.ConsumeIntegralInRange<int>(0, 7) == 0) return any_id();
    auto it = live_.begin();
    std::advance(it, in_.ConsumeIntegralInRange<std::size_t>(0, live_.size() - 1));
    return it->first;
  }
  std::int32_t any_layer() { return in_.ConsumeIntegralInRange<std::int32_t>(-1, layers_); }
  Precision any_precision() { return static_cast<Precision>(in_.ConsumeIntegralInRange<std::uint8_t>(0, 3)); }
  Tag fresh_tag() { return mix(++tag_counter_); }
  bool resident(SequenceId id) const { return live_.contains(id) && !cache_.is_swapped(id); }

  TokenLayout random_layout() {
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) return TokenLayout();  // empty: InvalidArgument
    std::vector<Segment> segments(in_.ConsumeIntegralInRange<std::size_t>(1, 4));
    const bool huge = in_.ConsumeIntegralInRange<int>(0, 9) == 0;  // usually more than the arena holds
    for (Segment& s : segments) {
      s.kind = in_.ConsumeBool() ? TokenKind::Visual : TokenKind::Text;
      s.length = huge ? in_.ConsumeIntegralInRange<std::int32_t>(50, 700)
                      : in_.ConsumeIntegralInRange<std::int32_t>(1, 3 * bs_ + 5);
    }
    return TokenLayout(std::move(segments));
  }

  PrecisionPlan random_plan(const TokenLayout& layout) {
    std::int32_t layers = layers_;
    std::int32_t windows = layout.num_windows(bs_);
    if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) {  // the wrong shape
      if (in_.ConsumeBool()) {
        layers = in_.ConsumeIntegralInRange<std::int32_t>(1, 4);
      } else {
        windows = in_.ConsumeIntegralInRange<std::int32_t>(0, windows + 2);
      }
    }
    PrecisionPlan plan(layers, windows);
    const int mode = in_.ConsumeIntegralInRange<int>(0, 4);  // sometimes a whole prompt in one pool
    for (std::int32_t w = 0; w < windows; ++w) {
      plan.set_score(w, static_cast<float>(in_.ConsumeIntegralInRange<int>(-100, 100)) / 100.0f);
      for (std::int32_t l = 0; l < layers; ++l) {
        plan.set(
            l, w,
            mode < 3 ? static_cast<Precision>(mode) : static_cast<Precision>(in_.ConsumeIntegralInRange<int>(0, 2)));
      }
    }
    return plan;
  }

  // --- calls
  bool add() {
    const SequenceId id = any_id();
    const TokenLayout layout = random_layout();
    const PrecisionPlan plan = random_plan(layout);
    if (cache_.config().prefix_cache.enabled && layout.num_tokens() > 0 && in_.ConsumeBool()) {
      return add_with_keys(id, layout, plan);
    }
    std::optional<bool> predicted;  // can_allocate(demand) for a well-formed request
    attempt("demand", [&] { predicted = cache_.can_allocate(cache_.demand(layout, plan)); });
    const Outcome outcome = attempt("add_sequence", [&] { cache_.add_sequence(id, layout, plan); });
    if (predicted && !live_.contains(id) && *predicted != (outcome == Outcome::Ok)) {
      finding("can_allocate(demand) said " + std::string(*predicted ? "yes" : "no") + " but add_sequence(" +
              std::to_string(id) + ") " + (outcome == Outcome::Ok ? "succeeded" : "failed"));
    }
    if (outcome != Outcome::Ok) return false;
    Live& seq = live_[id];
    for (std::int32_t pos = 0; pos < layout.num_tokens(); ++pos) seq.tokens.push_back(fresh_tag());
    seq.handle = cache_.handle(id);
    // store_prefill: every prompt row where the mapping says.
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      const StoreMapping m = cache_.prefill_mapping(id, layer);
      write_prefill(seq.tokens, layer, m);
    }
    return true;
  }

  // A prompt the prefix cache may serve in part: the match predicts the
  // call, the rows it serves already read as this prompt's (verified after
  // the call), the others are stored, each into a block nobody else holds.
  bool add_with_keys(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan) {
    const std::vector<TokenKey> keys = prompt_keys(in_, layout, bs_);
    std::optional<bool> predicted;
    PrefixMatch probe;
    attempt("match_prefix", [&] {
      probe = cache_.match_prefix(layout, plan, keys);
      predicted = cache_.can_allocate(probe.demand, probe);
    });
    PrefixMatch got;
    const Outcome outcome = attempt("add_sequence(keys)", [&] { got = cache_.add_sequence(id, layout, plan, keys); });
    if (predicted && !live_.contains(id) && *predicted != (outcome == Outcome::Ok)) {
      finding("can_allocate(match.demand, match) and add_sequence(keys) disagree");
    }
    if (outcome != Outcome::Ok) return false;
    if (got.rows != probe.rows || got.plan != cache_.plan(id))
      finding("add_sequence(keys) did not do what match_prefix said");
    Live& seq = live_[id];
    seq.tokens = prompt_tags(layout, keys, [&] { return fresh_tag(); });
    seq.keys = keys;
    seq.handle = cache_.handle(id);
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      const StoreMapping m = cache_.prefill_mapping(id, layer);
      write_prefill(seq.tokens, layer, m, got.rows);
    }
    return true;
  }

  bool prefix() {
    if (in_.ConsumeIntegralInRange<int>(0, 3) == 0) {
      attempt("evict_prefix_cache", [&] { (void)cache_.evict_prefix_cache(); });
      return true;
    }
    const SequenceId id = some_id();
    std::vector<TokenKey> keys;
    if (live_.contains(id)) keys = live_.at(id).keys;
    keys.resize(std::min(keys.size(), in_.ConsumeIntegralInRange<std::size_t>(0, keys.size() + 2)));
    if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) keys.resize(keys.size() + 1000);  // longer than any prompt
    return attempt("publish_prefix", [&] { (void)cache_.publish_prefix(id, keys); }) == Outcome::Ok;
  }

  // Rows from `from` on; each into a block only this sequence holds.
  void write_prefill(const std::vector<Tag>& tokens, std::int32_t layer, const StoreMapping& m, std::int32_t from = 0) {
    for (std::size_t row = static_cast<std::size_t>(from); row < m.fp16_slots.size(); ++row) {
      if (m.fp16_slots[row] < 0) continue;
      if (cache_.ref_count(Precision::FP16, m.fp16_slots[row] / bs_) != 1)
        finding("a prefill row lands in a shared block");
      shadow_.fp16_slot(m.fp16_slots[row]) = layer_tag(tokens[row], layer);
    }
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      for (const WindowSlot& w : p == Precision::INT4 ? m.int4_windows : m.int2_windows) {
        if (w.first_row < from) continue;
        if (cache_.ref_count(p, w.block_id) != 1) finding("a prefill window lands in a shared block");
        shadow_.quantized(p, w.block_id) = window_tag(layer_tag(tokens[static_cast<std::size_t>(w.first_row)], layer));
      }
    }
  }

  // The tail block of every layer (-1 without FP16 blocks).
  std::vector<std::int32_t> tails(SequenceId id) const {
    std::vector<std::int32_t> t;
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      const auto fp16 = cache_.blocks(id, layer, Precision::FP16);
      t.push_back(fp16.empty() ? -1 : fp16.back());
    }
    return t;
  }

  bool append(bool by_handle) {
    std::vector<SequenceId> ids(in_.ConsumeIntegralInRange<std::size_t>(0, 4));
    for (SequenceId& id : ids) id = some_id();
    const AppendSlots form = in_.ConsumeBool() ? AppendSlots::Compact : AppendSlots::PerLayer;
    AppendResult result;
    Outcome outcome;
    std::vector<std::vector<std::int32_t>> tails_before;
    if (by_handle) {
      std::vector<SequenceHandle> handles;
      for (SequenceId& id : ids) {
        const auto it = live_.find(id);
        if (it != live_.end() && in_.ConsumeIntegralInRange<int>(0, 7) != 0) {
          handles.push_back(it->second.handle);
          continue;
        }
        if (!stale_.empty() && in_.ConsumeBool()) {
          handles.push_back(stale_[in_.ConsumeIntegralInRange<std::size_t>(0, stale_.size() - 1)]);
        } else {
          handles.push_back(
              {in_.ConsumeIntegralInRange<std::int32_t>(-1, 9), in_.ConsumeIntegralInRange<std::uint32_t>(0, 3)});
        }
        // A made-up handle may be a live one by chance; a stale one never is.
        id = -2;
        for (const auto& [live_id, seq] : live_) {
          if (seq.handle == handles.back()) id = live_id;
        }
      }
      for (const SequenceId id : ids) tails_before.push_back(resident(id) ? tails(id) : std::vector<std::int32_t>{});
      outcome = attempt("append_tokens(handles)", [&] { result = cache_.append_tokens(handles, form); });
      // A handle names the live sequence it was taken from, or none.
      if (outcome == Outcome::Ok && std::find(ids.begin(), ids.end(), SequenceId{-2}) != ids.end()) {
        finding("append_tokens accepted a stale or made-up handle");
      }
    } else {
      for (const SequenceId id : ids) tails_before.push_back(resident(id) ? tails(id) : std::vector<std::int32_t>{});
      outcome = attempt("append_tokens(ids)", [&] { result = cache_.append_tokens(ids, form); });
    }
    if (outcome != Outcome::Ok) return false;
    // The compact form (always there) agrees with the per-layer slots (when
    // asked for) and with the page tables; tails_changed lists exactly the
    // sequences whose tail moved.
    if (result.offsets.size() != ids.size()) finding("append_tokens: one offset per sequence");
    if (form == AppendSlots::PerLayer ? result.slots.size() != static_cast<std::size_t>(layers_)
                                      : !result.slots.empty()) {
      finding("append_tokens: slots per layer only in the PerLayer form");
    }
    std::vector<std::int32_t> changed;
    std::vector<std::vector<std::int32_t>> slots(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::vector<std::int32_t> after = tails(ids[i]);
      if (after != tails_before[i]) changed.push_back(static_cast<std::int32_t>(i));
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        const std::int32_t slot = after[static_cast<std::size_t>(layer)] * bs_ + result.offsets[i];
        slots[i].push_back(slot);
        if (form == AppendSlots::PerLayer) {
          const auto& per_layer = result.slots[static_cast<std::size_t>(layer)];
          if (per_layer.size() != ids.size() || per_layer[i] != slot) {
            finding("append_tokens: slots[layer][i] != tail * block_size + offsets[i]");
          }
        }
      }
    }
    if (result.tails_changed != changed ||
        result.tail_blocks.size() != changed.size() * static_cast<std::size_t>(layers_)) {
      finding("append_tokens: tails_changed does not list exactly the sequences whose tail block changed");
    }
    for (std::size_t k = 0; k < changed.size(); ++k) {
      const std::vector<std::int32_t> after = tails(ids[static_cast<std::size_t>(changed[k])]);
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        if (result.tail_blocks[k * static_cast<std::size_t>(layers_) + static_cast<std::size_t>(layer)] !=
            after[static_cast<std::size_t>(layer)]) {
          finding("append_tokens: tail_blocks disagrees with the page table");
        }
      }
    }
    for (const BlockCopy& c : result.copies) shadow_.copy_fp16_block(c.src, c.dst);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      Live& seq = live_.at(ids[i]);
      seq.tokens.push_back(fresh_tag());
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        shadow_.fp16_slot(slots[i][static_cast<std::size_t>(layer)]) = layer_tag(seq.tokens.back(), layer);
      }
    }
    return true;
  }

  // Speculative decoding: counts[i] tokens for ids[i] (a count list of the
  // wrong length now and then), written where the page tables put them.
  bool append_rows() {
    std::vector<SequenceId> ids(in_.ConsumeIntegralInRange<std::size_t>(0, 3));
    for (SequenceId& id : ids) id = some_id();
    std::vector<std::int32_t> counts(ids.size() + (in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? 1 : 0));
    for (std::int32_t& c : counts) c = in_.ConsumeIntegralInRange<std::int32_t>(-1, 2 * bs_ + 2);
    const AppendSlots form = in_.ConsumeBool() ? AppendSlots::Compact : AppendSlots::PerLayer;
    AppendResult r;
    if (attempt("append_tokens(counts)", [&] { r = cache_.append_tokens(ids, counts, form); }) != Outcome::Ok) {
      return false;
    }
    for (const BlockCopy& c : r.copies) shadow_.copy_fp16_block(c.src, c.dst);
    std::size_t row = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      Live& seq = live_.at(ids[i]);
      const PageTable& t = cache_.page_table(ids[i]);
      for (std::int32_t j = 0; j < counts[i]; ++j, ++row) {
        seq.tokens.push_back(fresh_tag());
        for (std::int32_t layer = 0; layer < layers_; ++layer) {
          const std::int32_t slot = t.fp16_slot(layer, t.fp16_tokens(layer) - counts[i] + j);
          if (form == AppendSlots::PerLayer && r.slots[static_cast<std::size_t>(layer)][row] != slot) {
            finding("append_tokens(counts): slots[layer][row] is not where the page table puts the token");
          }
          shadow_.fp16_slot(slot) = layer_tag(seq.tokens.back(), layer);
        }
      }
    }
    return true;
  }

  bool truncate() {
    const SequenceId id = some_id();
    const auto held = held_blocks(id);
    const auto tokens = static_cast<std::int32_t>(live_.contains(id) ? live_.at(id).tokens.size() : 0);
    const std::int32_t keep = tokens - in_.ConsumeIntegralInRange<std::int32_t>(-1, 2 * bs_ + 2);
    if (attempt("truncate", [&] { cache_.truncate(id, keep); }) != Outcome::Ok) return false;
    live_.at(id).tokens.resize(static_cast<std::size_t>(keep));
    poison_released(held);
    return true;
  }

  bool fork() {
    const SequenceId parent = some_id();
    const SequenceId child = any_id();
    if (attempt("fork", [&] { cache_.fork(parent, child); }) != Outcome::Ok) return false;
    live_[child] = Live{live_.at(parent).tokens, cache_.handle(child), live_.at(parent).keys};
    return true;
  }

  bool free_one() {
    const SequenceId id = some_id();
    const auto held = held_blocks(id);
    if (attempt("free_sequence", [&] { cache_.free_sequence(id); }) != Outcome::Ok) return false;
    stale_.push_back(live_.at(id).handle);
    live_.erase(id);
    poison_released(held);
    return true;
  }

  bool swap_out() {
    const SequenceId id = some_id();
    const auto held = held_blocks(id);
    std::vector<SwapCopy> copies;
    if (attempt("swap_out", [&] { copies = cache_.swap_out(id); }) != Outcome::Ok) return false;
    shadow_.swap(copies, /*to_host=*/true);
    poison_released(held);
    return true;
  }

  bool swap_in() {
    const SequenceId id = some_id();
    std::optional<bool> predicted;
    if (live_.contains(id) && cache_.is_swapped(id)) predicted = cache_.can_allocate(cache_.blocks_held(id));
    std::vector<SwapCopy> copies;
    const Outcome outcome = attempt("swap_in", [&] { copies = cache_.swap_in(id); });
    if (predicted && *predicted != (outcome == Outcome::Ok)) {
      finding("can_allocate(blocks_held) and swap_in(" + std::to_string(id) + ") disagree");
    }
    if (outcome != Outcome::Ok) return false;
    shadow_.swap(copies, /*to_host=*/false);
    return true;
  }

  bool demote() {
    std::vector<Demotion> list(in_.ConsumeIntegralInRange<std::size_t>(0, 4));
    bool all_valid = true;
    BlockCounts need{};
    for (Demotion& d : list) {
      d.id = some_id();
      d.layer = in_.ConsumeIntegralInRange<std::int32_t>(0, layers_);  // layers_ is out of range
      const std::int32_t windows = live_.contains(d.id) ? cache_.plan(d.id).num_windows() : 2;
      d.window = in_.ConsumeIntegralInRange<std::int32_t>(0, windows);
      d.target = in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? any_precision()
                                                             : (in_.ConsumeBool() ? Precision::INT4 : Precision::INT2);
      std::optional<std::string> why;
      const Outcome o =
          attempt("why_not_demotable", [&] { why = cache_.why_not_demotable(d.id, d.layer, d.window, d.target); });
      all_valid = all_valid && o == Outcome::Ok && !why;
      if (all_valid) ++need[static_cast<std::size_t>(pool_index(d.target))];
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      for (std::size_t j = 0; j < i; ++j) {
        all_valid = all_valid &&
                    !(list[i].id == list[j].id && list[i].layer == list[j].layer && list[i].window == list[j].window);
      }
    }
    // Windows that why_not_demotable() accepts, each listed once, are demoted
    // exactly when the accounting says their target blocks can be had.
    const std::optional<bool> predicted = all_valid ? std::optional<bool>(cache_.can_allocate(need)) : std::nullopt;
    std::vector<DemoteOp> ops;
    const Outcome outcome = attempt("demote", [&] { ops = cache_.demote(list); });
    if (predicted && outcome != (*predicted ? Outcome::Ok : Outcome::OutOfMemory)) {
      finding("demote of demotable windows: can_allocate(targets) = " + std::string(*predicted ? "yes" : "no") +
              " but the call " + (outcome == Outcome::Ok ? "succeeded" : "threw another error"));
    }
    if (outcome != Outcome::Ok) return false;
    if (ops.size() != list.size()) finding("demote: one op per demotion");
    shadow_.demote(ops);
    std::vector<std::pair<Precision, std::int32_t>> sources;
    for (const DemoteOp& op : ops) sources.emplace_back(op.src_precision, op.src_block);
    poison_released(sources);
    return true;
  }

  void metadata() {
    std::vector<SequenceId> ids(in_.ConsumeIntegralInRange<std::size_t>(0, 5));
    for (SequenceId& id : ids) id = some_id();
    DecodeMetadata meta;
    if (attempt("decode_metadata", [&] { meta = cache_.decode_metadata(ids); }) != Outcome::Ok) return;
    if (meta.batch_size != static_cast<std::int32_t>(ids.size()) ||
        meta.layers.size() != static_cast<std::size_t>(layers_)) {
      finding("decode_metadata: batch size or layer count");
    }
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      for (const Precision p : kAllPrecisions) {
        const PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][static_cast<std::size_t>(pool_index(p))];
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto blocks = cache_.blocks(ids[i], layer, p);
          const std::vector<std::int32_t> got(t.indices.begin() + t.indptr[i], t.indices.begin() + t.indptr[i + 1]);
          const std::int32_t last =
              blocks.empty() ? 0 : (p == Precision::FP16 ? cache_.fp16_tail_fill(ids[i], layer) : bs_);
          if (got != std::vector<std::int32_t>(blocks.begin(), blocks.end()) || t.last_block_len[i] != last) {
            finding("decode_metadata disagrees with blocks() for ids[" + std::to_string(i) + "]");
          }
        }
      }
    }
  }

  // The prefill mapping of a resident sequence still points at its prompt
  // rows, after appends, forks, copy-on-write, swaps and demotions.
  void mapping() {
    const SequenceId id = some_id();
    const std::int32_t layer = any_layer();
    StoreMapping m;
    if (attempt("prefill_mapping", [&] { m = cache_.prefill_mapping(id, layer); }) != Outcome::Ok) return;
    const std::vector<Tag>& tokens = live_.at(id).tokens;
    if (static_cast<std::int32_t>(m.fp16_slots.size()) != cache_.layout(id).num_tokens()) {
      finding("prefill_mapping: one entry per prompt row");
    }
    for (std::size_t row = 0; row < m.fp16_slots.size(); ++row) {
      if (m.fp16_slots[row] >= 0 && shadow_.fp16_slot(m.fp16_slots[row]) != layer_tag(tokens[row], layer)) {
        finding("prefill_mapping(" + std::to_string(id) + ", " + std::to_string(layer) + ") row " +
                std::to_string(row) + " points at another token's slot");
      }
    }
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      for (const WindowSlot& w : p == Precision::INT4 ? m.int4_windows : m.int2_windows) {
        if (shadow_.quantized(p, w.block_id) !=
            window_tag(layer_tag(tokens[static_cast<std::size_t>(w.first_row)], layer))) {
          finding("prefill_mapping: a window points at another window's block");
        }
      }
    }
  }

  // Read-only calls with arbitrary arguments: typed errors only, no change.
  void inspect() {
    const SequenceId id = some_id();
    const std::int32_t layer = any_layer();
    const Precision p = any_precision();
    switch (in_.ConsumeIntegralInRange<int>(0, 13)) {
      case 0: attempt("blocks", [&] { (void)cache_.blocks(id, layer, p); }); break;
      case 1: attempt("fp16_tail_fill", [&] { (void)cache_.fp16_tail_fill(id, layer); }); break;
      case 2:
        attempt("ref_count", [&] { (void)cache_.ref_count(p, in_.ConsumeIntegralInRange<std::int32_t>(-2, 200)); });
        break;
      case 3:
        attempt("why_not_demotable", [&] {
          (void)cache_.why_not_demotable(id, layer, in_.ConsumeIntegralInRange<std::int32_t>(-1, 12), p);
        });
        break;
      case 4: {
        BlockCounts counts{};
        for (std::int64_t& c : counts) c = in_.ConsumeIntegralInRange<std::int64_t>(-1, 100);
        attempt("can_allocate", [&] { (void)cache_.can_allocate(counts); });
        break;
      }
      case 5: attempt("blocks_held", [&] { (void)cache_.blocks_held(id); }); break;
      case 6: attempt("page_table", [&] { (void)cache_.page_table(id).num_layers(); }); break;
      case 7: {
        std::byte base{};
        attempt("pool_view", [&] { (void)cache_.pool_view(p, in_.ConsumeBool() ? &base : nullptr); });
        break;
      }
      case 8: {
        std::byte base{};
        attempt("swap_view", [&] { (void)cache_.swap_view(p, in_.ConsumeBool() ? &base : nullptr); });
        break;
      }
      case 9: attempt("pool_stats", [&] { (void)cache_.pool_stats(p); }); break;
      case 10: attempt("format", [&] { (void)cache_.format(p); }); break;
      case 11: attempt("is_swapped", [&] { (void)cache_.is_swapped(id); }); break;
      case 12:
        attempt("num_tokens/layout/plan", [&] {
          (void)cache_.num_tokens(id);
          (void)cache_.layout(id);
          (void)cache_.plan(id);
        });
        break;
      default: {
        const TokenLayout layout = random_layout();
        const PrecisionPlan plan = random_plan(layout);
        attempt("demand", [&] { (void)cache_.demand(layout, plan); });
        break;
      }
    }
  }

  // --- checks
  void check_all(const std::string& before, bool unchanged) {
    check_consistency(cache_, before, unchanged);
    for (const auto& [id, seq] : live_) {
      if (!cache_.contains(id)) finding("sequence " + std::to_string(id) + " vanished");
      if (!cache_.is_swapped(id)) shadow_.verify(id, seq.tokens);
    }
    if (cache_.sequence_ids().size() != live_.size()) finding("the manager holds sequences the harness never added");
  }

  // Blocks a resident sequence holds now, to poison those freed by the call.
  std::vector<std::pair<Precision, std::int32_t>> held_blocks(SequenceId id) const {
    std::vector<std::pair<Precision, std::int32_t>> held;
    if (!resident(id)) return held;
    for (std::int32_t layer = 0; layer < layers_; ++layer) {
      for (const Precision p : kAllPrecisions) {
        for (const std::int32_t b : cache_.blocks(id, layer, p)) held.emplace_back(p, b);
      }
    }
    return held;
  }

  // A block nobody holds any more reads as garbage: a table that still lists
  // it fails verify().
  void poison_released(const std::vector<std::pair<Precision, std::int32_t>>& blocks) {
    for (const auto& [p, b] : blocks) {
      if (cache_.ref_count(p, b) != 0) continue;
      if (p == Precision::FP16) {
        for (std::int32_t t = 0; t < bs_; ++t) shadow_.fp16_slot(b * bs_ + t) = 0;
      } else {
        shadow_.quantized(p, b) = 0;
      }
    }
  }

  // Frees everything: every block and host slot comes back.
  void drain() {
    for (const auto& entry : live_) {
      if (attempt("free_sequence (drain)", [&] { cache_.free_sequence(entry.first); }) != Outcome::Ok) {
        finding("free_sequence of a live sequence failed");
      }
    }
    live_.clear();
    (void)cache_.evict_prefix_cache();  // what only the prefix index holds
    check_all(cache_.describe_state(), false);
    std::int32_t slabs = cache_.free_slabs();
    for (const Precision p : kAllPrecisions) {
      const PoolStats st = cache_.pool_stats(p);
      if (st.used_blocks != 0 || st.free_blocks != static_cast<std::int64_t>(st.slabs) * st.blocks_per_slab) {
        finding(std::string(to_string(p)) + " pool: blocks still used after every sequence was freed");
      }
      slabs += st.slabs;
    }
    if (slabs != cache_.total_slabs()) finding("slabs lost");
    if (cache_.free_swap_slots() != cache_.config().swap_blocks) finding("host swap slots lost");
  }

  FuzzedDataProvider& in_;
  KVCacheManager& cache_;
  Shadow shadow_;
  std::int32_t bs_ = 0;
  std::int32_t layers_ = 0;
  std::map<SequenceId, Live> live_;
  std::vector<SequenceHandle> stale_;  // handles of freed sequences
  Tag tag_counter_ = 0;
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
