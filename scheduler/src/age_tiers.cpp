// Age tiers (docs/scheduler.md, "Age tiers"): between steps, windows that
// aged past the recent ones move to their layer's tier precision, in the
// step's one demote call after the plans' demotions.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::at;
using scheduler_detail::Entry;

void Scheduler::Impl::configure_ages() {
  // The knobs are checked whether or not tiers are on: a bad value is a
  // mistake either way.
  const AgeTierPolicy& a = config.age_tiers;
  auto bad = [](const std::string& what) { throw InvalidArgument("config.age_tiers." + what); };
  if (a.sink_windows < 0) bad("sink_windows = " + std::to_string(a.sink_windows) + ", expected >= 0");
  if (a.recent_windows < 1) {
    bad("recent_windows = " + std::to_string(a.recent_windows) +
        ", expected >= 1 (the last full window stays FP16, so drafts and the open tail are never demoted)");
  }
  if (!a.layer_floor.empty() && a.layer_floor.size() != static_cast<std::size_t>(num_layers)) {
    bad("layer_floor has " + std::to_string(a.layer_floor.size()) + " layers, expected 0 or " +
        std::to_string(num_layers) + " (the cache's num_layers)");
  }
  for (std::size_t l = 0; l < a.layer_floor.size(); ++l) {
    const int p = pool_index(a.layer_floor[l]);
    if (p < 0 || p >= kNumPrecisions) {
      bad("layer_floor[" + std::to_string(l) + "] = " + std::to_string(p) +
          ", expected FP16 (0), INT4 (1) or INT2 (2)");
    }
  }
  if (!a.enabled) return;
  if (!cache.config().fp16_windows_first) {
    bad("enabled = true needs the cache's fp16_windows_first = true (CacheConfig::fp16_windows_first): an old "
        "window moves as one whole FP16 block");
  }
  tiers.assign(static_cast<std::size_t>(num_layers), Precision::INT4);
  if (!a.layer_floor.empty()) tiers = a.layer_floor;
  for (std::size_t l = 0; l < floors.size(); ++l) {
    if (pool_index(floors[l]) < pool_index(tiers[l])) tiers[l] = floors[l];  // the planner's floor is higher
  }
}

std::int32_t Scheduler::Impl::stream_position(const Entry& e, std::int64_t i) const {
  std::int64_t pos = 0;
  for (const Segment& s : e.prompt.segments()) {
    if (s.kind == TokenKind::Text) {
      if (i < s.length) return static_cast<std::int32_t>(pos + i);
      i -= s.length;
      pos += s.length;
      continue;
    }
    const std::int64_t windows = s.length / block_size * block_size;  // tokens in full windows
    if (i < s.length - windows) return static_cast<std::int32_t>(pos + windows + i);
    i -= s.length - windows;
    pos += s.length;
  }
  return static_cast<std::int32_t>(std::min<std::int64_t>(pos + i, std::numeric_limits<std::int32_t>::max()));
}

// Per Running request whose next window is old by now (O(1) otherwise):
// its stream blocks and visual windows in order while old, each layer to
// its tier unless the layer's tier is FP16, the window is a sink, the plan
// set it below FP16, or its block is shared (fork, prefix hit: a shared
// block is never demoted under another holder, and a private copy would
// cost a block, so it stays FP16). Windows are taken whole (every layer)
// while the pools can give their targets; the first that cannot ends the
// list for this step, and its request and the later ones wait (in order).
void Scheduler::Impl::collect_ages(PlanDemotions& plans) {
  const std::int64_t bs = block_size;
  const std::int64_t recent = std::int64_t{config.age_tiers.recent_windows} * bs;
  const std::int64_t sink = std::int64_t{config.age_tiers.sink_windows} * bs;
  bool full = false;
  std::vector<Demotion> unit;  // one window's demotions, every layer
  // Adds `unit` to the step's list when its targets can be had next to the
  // list's; false when they cannot.
  auto take = [&] {
    BlockCounts want = plans.taken;
    for (const Demotion& d : unit) ++want[at(d.target)];
    if (!unit.empty() && !cache.can_allocate(want)) return false;
    plans.list.insert(plans.list.end(), unit.begin(), unit.end());
    plans.taken = want;
    plans.freed += static_cast<std::int64_t>(unit.size());
    plans.aged += static_cast<std::int64_t>(unit.size());
    return true;
  };
  for (Entry* e : decoding) {
    if (e->exact || e->num_tokens < e->next_age_at) continue;
    if (full) {
      ++stats.age_waits;
      continue;
    }
    if (vanished(*e)) continue;  // the step retires it
    const std::int64_t n = e->num_tokens;
    auto old = [&](std::int64_t last) { return n - 1 - last >= recent; };
    const PrecisionPlan& held = cache.plan(e->id);
    const std::int32_t windows = held.num_windows();
    std::int32_t stream = e->aged_stream;
    for (; !full; ++stream) {
      const std::int64_t first = std::int64_t{stream} * bs;
      if (!old(stream_position(*e, first + bs - 1))) break;
      if (stream_position(*e, first) < sink) continue;
      unit.clear();
      for (std::int32_t layer = 0; layer < num_layers; ++layer) {
        const Precision t = tiers[static_cast<std::size_t>(layer)];
        if (t == Precision::FP16 || cache.why_not_stream_demotable(e->id, layer, stream, t)) continue;
        unit.push_back({e->id, layer, stream, t, true});
      }
      full = !take();
      if (full) break;
    }
    std::int32_t window = e->aged_window;
    for (; window < windows && !full; ++window) {
      const std::int64_t start = e->window_starts[static_cast<std::size_t>(window)];
      if (!old(start + bs - 1)) break;
      if (window == 0 || start < sink) continue;
      unit.clear();
      for (std::int32_t layer = 0; layer < num_layers; ++layer) {
        const Precision t = tiers[static_cast<std::size_t>(layer)];
        if (t == Precision::FP16 || held.at(layer, window) != Precision::FP16) continue;
        if (cache.why_not_demotable(e->id, layer, window, t)) continue;
        unit.push_back({e->id, layer, window, t});
      }
      full = !take();
      if (full) break;
    }
    // The token count at which the next stream block or window is old; a
    // request cut short looks again at the next step.
    std::int64_t next = stream_position(*e, std::int64_t{stream} * bs + bs - 1) + 1 + recent;
    if (window < windows) next = std::min(next, e->window_starts[static_cast<std::size_t>(window)] + bs + recent);
    if (full) {
      next = n;
      ++stats.age_waits;
    }
    plans.advances.push_back(
        {e, stream, window,
         static_cast<std::int32_t>(std::min<std::int64_t>(next, std::numeric_limits<std::int32_t>::max()))});
  }
}

// Per layer: the plan's windows, those the plan left FP16 moved to the tier
// once old (not sinks, not window 0), and the stream's blocks at `tokens`
// tokens, the old ones (not sinks) at the tier.
BlockCounts Scheduler::Impl::aged_blocks(const Entry& e, const PrecisionPlan& plan, std::int64_t tokens) const {
  const std::int64_t bs = block_size;
  const std::int64_t recent = std::int64_t{config.age_tiers.recent_windows} * bs;
  const std::int64_t sink = std::int64_t{config.age_tiers.sink_windows} * bs;
  auto old = [&](std::int64_t last) { return tokens - 1 - last >= recent; };
  const std::int64_t stream = tokens - std::int64_t{plan.num_windows()} * bs;
  std::int64_t aged = 0;  // old stream blocks, not sinks
  for (std::int64_t k = 0; k < stream / bs && old(stream_position(e, k * bs + bs - 1)); ++k) {
    aged += stream_position(e, k * bs) >= sink ? 1 : 0;
  }
  std::vector<std::uint8_t> old_window(static_cast<std::size_t>(plan.num_windows()), 0);
  for (std::int32_t w = 1; w < plan.num_windows(); ++w) {
    const std::int64_t start = e.window_starts[static_cast<std::size_t>(w)];
    old_window[static_cast<std::size_t>(w)] = start >= sink && old(start + bs - 1) ? 1 : 0;
  }
  BlockCounts blocks{};
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    const Precision t = tiers[static_cast<std::size_t>(layer)];
    const auto windows = plan.window_counts(layer);
    std::int64_t moved = 0;  // FP16 windows the tier takes
    if (t != Precision::FP16) {
      for (std::int32_t w = 1; w < plan.num_windows(); ++w) {
        moved += old_window[static_cast<std::size_t>(w)] != 0 && plan.at(layer, w) == Precision::FP16 ? 1 : 0;
      }
    }
    const std::int64_t stream_aged = t != Precision::FP16 ? aged : 0;
    blocks[0] += windows[0] - moved + (stream + bs - 1) / bs - stream_aged;
    blocks[1] += windows[1];
    blocks[2] += windows[2];
    blocks[at(t)] += t != Precision::FP16 ? moved + stream_aged : 0;
  }
  return blocks;
}

// The most is either the prompt before its first demotions or the end,
// every old window demoted: in between the FP16 part stays within a block
// of the end's while quantized blocks only grow (the block before the end
// covers a step whose old window waits while its new tail opens).
BlockCounts Scheduler::Impl::aged_footprint(const Entry& e, const PrecisionPlan& plan, std::int64_t end) const {
  BlockCounts last = aged_blocks(e, plan, end);
  if (end > e.prompt.num_tokens()) {
    const BlockCounts before = aged_blocks(e, plan, end - 1);
    for (const Precision p : kAllPrecisions) last[at(p)] = std::max(last[at(p)], before[at(p)]);
  }
  const BlockCounts prompt = cache.demand(e.prompt, plan);
  return slabs_for(prompt) > slabs_for(last) ? prompt : last;
}

void Scheduler::Impl::check_ages(const Entry& e, const std::string& who) const {
  auto fail = [&](const std::string& what) { throw InvariantViolation("scheduler: " + who + " " + what); };
  if (tiers.empty()) {
    if (e.aged_stream != 0 || e.aged_window != 0) fail("has age-tier cursors with age tiers off");
    return;
  }
  if (e.state == RequestState::Waiting) {
    if (e.aged_stream != 0 || e.aged_window != 0 || e.next_age_at != 0) fail("waits with age-tier cursors set");
    return;
  }
  const std::int32_t blocks = cache.stream_blocks(e.id);
  if (e.aged_stream < 0 || e.aged_stream > blocks || e.aged_window < 0 ||
      e.aged_window > cache.plan(e.id).num_windows()) {
    fail("has age-tier cursors (stream " + std::to_string(e.aged_stream) + ", window " + std::to_string(e.aged_window) +
         ") outside its " + std::to_string(blocks) + " stream blocks");
  }
  const std::int64_t bs = block_size;
  const std::int64_t recent = std::int64_t{config.age_tiers.recent_windows} * bs;
  const std::int64_t sink = std::int64_t{config.age_tiers.sink_windows} * bs;
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    for (std::int32_t k = 0; k < blocks; ++k) {
      const Precision p = cache.stream_precision(e.id, layer, k);
      if (p == Precision::FP16) continue;
      const std::string where = " stream block " + std::to_string(k) + " of layer " + std::to_string(layer);
      if (p != tiers[static_cast<std::size_t>(layer)]) {
        fail("holds" + where + " at " + std::string(to_string(p)) + ", the layer's tier is " +
             std::string(to_string(tiers[static_cast<std::size_t>(layer)])));
      }
      if (k >= e.aged_stream) fail("holds" + where + " demoted past its age-tier cursor");
      if (stream_position(e, k * bs) < sink) fail("demoted the sink" + where);
      if (e.num_tokens - 1 - stream_position(e, k * bs + bs - 1) < recent) fail("demoted the recent" + where);
    }
  }
}

}  // namespace mixkv
