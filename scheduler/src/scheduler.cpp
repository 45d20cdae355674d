#include "mixkv/scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <queue>
#include <string>
#include <tuple>
#include <utility>

#include <boost/intrusive/set.hpp>
#include <boost/unordered/unordered_flat_map.hpp>
#include <boost/unordered/unordered_flat_set.hpp>
#include <boost/unordered_map.hpp>

#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

using SetHook = boost::intrusive::set_member_hook<boost::intrusive::link_mode<boost::intrusive::safe_link>>;

std::size_t at(Precision p) { return static_cast<std::size_t>(pool_index(p)); }

// The scheduler's record of one live request.
struct Entry {
  // What a decode step touches, together at the front.
  SequenceHandle handle;             // while in the cache
  std::int32_t num_tokens = 0;       // tokens in the cache (prompt + appended decode tokens)
  std::int32_t generated = 0;        // tokens generated
  std::int32_t max_new_tokens = 1;
  std::int32_t slot = -1;
  std::int32_t decode_index = -1;    // position in Impl::decoding while Running
  RequestState state = RequestState::Waiting;
  bool done = false;                 // generated max_new_tokens; retired at the next step
  RequestId id = 0;
  const PageTable* table = nullptr;  // while resident in device memory

  SetHook hook;  // in exactly one of waiting, running, swapped

  // Fixed at add_request: the queue key and the request's limits.
  std::int32_t neg_priority = 0;  // -priority under SchedulingPolicy::Priority, else 0
  double arrival = 0.0;
  std::int64_t order = 0;  // add_request order: the last tie-break
  TokenLayout original;

  // The prompt to prefill now: the original, plus the generated tokens as
  // text after a recompute. The plan follows the manager's after demotions.
  TokenLayout prompt;
  PrecisionPlan plan;
  BlockCounts demand{};  // cache.demand(prompt, plan)
  std::vector<std::int32_t> window_starts;  // of prompt (text adds no window)

  std::int32_t computed = 0;  // prompt rows computed
  std::int32_t preemptions = 0;
  std::int32_t bypassed = 0;  // steps in which requests behind it were admitted instead
  // `generated` when it was last swapped out as the only request holding
  // device memory, -1 if never: a second such swap-out with no token
  // generated in between is a livelock (Impl::preempt).
  std::int32_t lone_swap_at = -1;

  // Demotion candidates: windows 1.. in ascending similarity score, and how
  // far demotion has gone through them, FP16 -> INT4 and INT4 -> INT2.
  std::vector<std::int32_t> demote_order;
  std::size_t demote_cursor = 0;
  std::size_t int2_cursor = 0;
};

struct KeyLess {
  bool operator()(const Entry& a, const Entry& b) const {
    return std::tie(a.neg_priority, a.arrival, a.order) < std::tie(b.neg_priority, b.arrival, b.order);
  }
};

using Queue = boost::intrusive::multiset<Entry, boost::intrusive::member_hook<Entry, SetHook, &Entry::hook>,
                                         boost::intrusive::compare<KeyLess>>;

std::string counts_text(const BlockCounts& c) {
  return "FP16 " + std::to_string(c[0]) + ", INT4 " + std::to_string(c[1]) + ", INT2 " + std::to_string(c[2]);
}

}  // namespace

struct Scheduler::Impl {
  KVCacheManager& cache;
  SchedulerConfig config;
  std::optional<WindowPlanner> planner;
  std::int32_t num_layers = 0;
  std::int32_t block_size = 0;
  std::int64_t reserve_fp16 = 0;  // watermark, in FP16 blocks
  // With demotion on, decode growth starts demoting while one slab is still
  // obtainable: a demotion needs INT4 room, which FP16 growth would
  // otherwise have taken to the last slab.
  std::int64_t demote_headroom = 0;
  std::int64_t fp16_limit = 0;  // FP16 blocks of the whole arena (fp16_room's bound)
  // The planner's per-layer floors (PlannerConfig::min_precision; empty:
  // none) bind demotion too: a layer kept at FP16 or INT4 by the user's
  // choice is not demoted under pressure; preemption makes the room instead.
  std::vector<Precision> floors;

  boost::unordered_map<RequestId, Entry> entries;  // node-based: hooks need stable addresses
  boost::unordered_flat_set<RequestId> retired;    // finished, cancelled or rejected
  Queue waiting;
  Queue running;  // Prefilling and Running, in key order (victims from the back)
  // The Running ones again, unordered, for the decode step's one pass.
  std::vector<Entry*> decoding;
  std::int32_t prefilling = 0;
  Queue swapped;
  std::vector<std::int32_t> free_slots;  // stack
  std::vector<Entry*> done;              // reached max_new_tokens last step
  std::vector<FinishedRequest> finished_reports;
  std::vector<RejectedRequest> rejected_reports;
  std::vector<RequestId> last_decodes;
  std::int64_t next_order = 0;
  SchedulerStats stats;

  Impl(KVCacheManager& c, SchedulerConfig cfg);

  Entry& live(RequestId id, const char* name);
  void plan_prefix(Entry& e) const;
  BlockCounts footprint(const Entry& e, const PrecisionPlan& plan) const;
  std::int64_t slabs_for(const BlockCounts& blocks) const;
  std::optional<std::string> never_fits(const Entry& e) const;
  std::int32_t chunk_end(const Entry& e, std::int32_t budget) const;
  bool fits(const BlockCounts& blocks, bool with_reserve) const;

  void set_state(Entry& e, RequestState state);
  void take_slot(Entry& e);
  void drop_slot(Entry& e);
  void release(Entry& e);                    // frees memory, unlinks, erases
  void retire(Entry& e, FinishReason reason);
  // finish() and cancel(): false for a request already retired.
  bool end_by_caller(RequestId id, FinishReason reason);
  void reject(Entry& e, std::string reason);
  void preempt(Entry& e, StepOutput& out);
  void relieve(std::vector<Entry*>& decodes, std::int64_t& need, StepOutput& out);

  bool below_floor(std::int32_t layer, Precision to) const {
    return !floors.empty() && pool_index(to) > pool_index(floors[static_cast<std::size_t>(layer)]);
  }
  std::int64_t fp16_room(const BlockCounts& taken, std::int64_t freed) const;
  void demote_for(std::int64_t need, std::int64_t target, const std::vector<Entry*>& decodes, StepOutput& out);
  void schedule_chunk(Entry& e, std::int32_t end, StepOutput& out);
  void build_metadata(const std::vector<Entry*>& decodes, StepOutput& out) const;
};

Scheduler::Impl::Impl(KVCacheManager& c, SchedulerConfig cfg) : cache(c), config(std::move(cfg)) {
  const CacheConfig& cc = cache.config();
  num_layers = cc.shape.num_layers;
  block_size = cc.shape.block_size;
  auto bad = [](const std::string& what) { throw InvalidArgument("config." + what); };
  if (config.max_num_seqs < 1) bad("max_num_seqs = " + std::to_string(config.max_num_seqs) + ", expected >= 1");
  if (config.max_num_batched_tokens < std::max(config.max_num_seqs, block_size)) {
    bad("max_num_batched_tokens = " + std::to_string(config.max_num_batched_tokens) +
        ", expected >= max(max_num_seqs, block_size) = " + std::to_string(std::max(config.max_num_seqs, block_size)));
  }
  if (!(config.watermark >= 0.0 && config.watermark < 1.0)) {
    bad("watermark = " + std::to_string(config.watermark) + ", expected 0 <= watermark < 1");
  }
  if (config.max_demotions_per_step < 0) {
    bad("max_demotions_per_step = " + std::to_string(config.max_demotions_per_step) + ", expected >= 0");
  }
  if (config.lookahead < 0) bad("lookahead = " + std::to_string(config.lookahead) + ", expected >= 0");
  if (config.max_head_bypass < 0) {
    bad("max_head_bypass = " + std::to_string(config.max_head_bypass) + ", expected >= 0");
  }
  const auto policy = static_cast<int>(config.policy);
  if (policy < 0 || policy > 1) bad("policy = " + std::to_string(policy) + ", expected FCFS (0) or Priority (1)");
  const auto mode = static_cast<int>(config.preemption);
  if (mode < 0 || mode > 1) bad("preemption = " + std::to_string(mode) + ", expected Recompute (0) or Swap (1)");
  if (config.planner) {
    if (config.planner->window_size != block_size) {
      bad("planner.window_size = " + std::to_string(config.planner->window_size) + ", expected the cache's block_size " +
          std::to_string(block_size));
    }
    planner.emplace(*config.planner);
    if (planner->num_layers() != num_layers) {
      bad("planner.sensitivities has " + std::to_string(planner->num_layers()) + " layers, expected " +
          std::to_string(num_layers) + " (the cache's num_layers)");
    }
  }
  if (planner) floors = config.planner->min_precision;
  if (!cache.sequence_ids().empty()) {
    throw InvalidArgument("cache holds " + std::to_string(cache.sequence_ids().size()) +
                          " sequences, expected an empty cache for the scheduler to drive");
  }
  const auto slabs = static_cast<std::int64_t>(std::ceil(config.watermark * cache.total_slabs()));
  reserve_fp16 = slabs * cache.pool_stats(Precision::FP16).blocks_per_slab;
  fp16_limit = std::int64_t{cache.total_slabs()} * cache.pool_stats(Precision::FP16).blocks_per_slab;
  const bool demotable = floors.empty() || std::ranges::any_of(floors, [](Precision p) { return p != Precision::FP16; });
  if (config.demote_under_pressure && config.max_demotions_per_step > 0 && demotable) {
    demote_headroom = cache.pool_stats(Precision::FP16).blocks_per_slab;
  }
  free_slots.reserve(static_cast<std::size_t>(config.max_num_seqs));
  for (std::int32_t s = config.max_num_seqs; s-- > 0;) free_slots.push_back(s);
}

Entry& Scheduler::Impl::live(RequestId id, const char* name) {
  const auto it = entries.find(id);
  if (it == entries.end()) {
    throw UnknownId(std::string(name) + " = " + std::to_string(id) + " is not a live request of this scheduler");
  }
  return it->second;
}

// Whether `blocks` can be had now, leaving the watermark for the running
// requests' growth when there are any.
bool Scheduler::Impl::fits(const BlockCounts& blocks, bool with_reserve) const {
  BlockCounts need = blocks;
  if (with_reserve && !running.empty()) need[0] += reserve_fp16;
  return cache.can_allocate(need);
}

// The most `e` will ever hold under `plan`: its prompt plus max_new_tokens - 1
// decode tokens (the last sampled token is never stored), all FP16.
BlockCounts Scheduler::Impl::footprint(const Entry& e, const PrecisionPlan& plan) const {
  BlockCounts most{};
  const std::int64_t more = e.max_new_tokens - 1 - (e.prompt.num_tokens() - e.original.num_tokens());
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    const auto windows = plan.window_counts(layer);
    const std::int64_t fp16 =
        e.prompt.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * block_size + std::max<std::int64_t>(more, 0);
    most[0] += (fp16 + block_size - 1) / block_size;
    most[1] += windows[1];
    most[2] += windows[2];
  }
  return most;
}

// Slabs that `blocks` take at the least (each pool's blocks packed).
std::int64_t Scheduler::Impl::slabs_for(const BlockCounts& blocks) const {
  std::int64_t slabs = 0;
  for (const Precision p : kAllPrecisions) {
    const std::int64_t per = cache.pool_stats(p).blocks_per_slab;
    slabs += (blocks[at(p)] + per - 1) / per;
  }
  return slabs;
}

// Why `e` can never run to completion in this cache, or nullopt.
std::optional<std::string> Scheduler::Impl::never_fits(const Entry& e) const {
  if (!config.chunked_prefill && e.prompt.num_tokens() > config.max_num_batched_tokens) {
    return "its prompt of " + std::to_string(e.prompt.num_tokens()) +
           " tokens exceeds max_num_batched_tokens = " + std::to_string(config.max_num_batched_tokens) +
           " and chunked_prefill is off";
  }
  const BlockCounts most = footprint(e, e.plan);
  const std::int64_t total = cache.total_slabs();
  if (slabs_for(most) > total) {
    return "with its " + std::to_string(e.max_new_tokens) + " new tokens it needs " + counts_text(most) +
           " blocks (" + std::to_string(slabs_for(most)) + " slabs), the whole cache holds " + std::to_string(total) +
           " slabs";
  }
  return std::nullopt;
}

// End of the chunk that starts at e.computed with `budget` tokens: never
// inside a visual window (a quantized window is stored from all its rows at
// once), 0 when no chunk fits.
std::int32_t Scheduler::Impl::chunk_end(const Entry& e, std::int32_t budget) const {
  const std::int32_t total = e.prompt.num_tokens();
  const std::int32_t remaining = total - e.computed;
  if (remaining <= budget) return total;
  if (!config.chunked_prefill) return 0;
  std::int32_t end = e.computed + budget;
  const auto next = std::upper_bound(e.window_starts.begin(), e.window_starts.end(), end - 1);
  if (next != e.window_starts.begin()) {
    const std::int32_t start = *std::prev(next);
    if (start < end && end < start + block_size) end = start;
  }
  return end > e.computed ? end : 0;
}

// Keeps `decoding` and the prefilling count in step with the states.
void Scheduler::Impl::set_state(Entry& e, RequestState state) {
  if (e.state == RequestState::Running) {
    Entry* last = decoding.back();
    decoding[static_cast<std::size_t>(e.decode_index)] = last;
    last->decode_index = e.decode_index;
    decoding.pop_back();
    e.decode_index = -1;
  }
  if (e.state == RequestState::Prefilling) --prefilling;
  e.state = state;
  if (state == RequestState::Running) {
    e.decode_index = static_cast<std::int32_t>(decoding.size());
    decoding.push_back(&e);
  }
  if (state == RequestState::Prefilling) ++prefilling;
}

void Scheduler::Impl::take_slot(Entry& e) {
  e.slot = free_slots.back();
  free_slots.pop_back();
}

void Scheduler::Impl::drop_slot(Entry& e) {
  if (e.slot >= 0) free_slots.push_back(e.slot);
  e.slot = -1;
  e.table = nullptr;
}

void Scheduler::Impl::release(Entry& e) {
  if (e.state == RequestState::Prefilling || e.state == RequestState::Running || e.state == RequestState::Swapped) {
    cache.free_sequence(e.id);
  }
  drop_slot(e);
  if (e.hook.is_linked()) {
    Queue& q = e.state == RequestState::Waiting ? waiting : (e.state == RequestState::Swapped ? swapped : running);
    q.erase(q.iterator_to(e));
  }
  set_state(e, RequestState::Finished);
  retired.insert(e.id);
  entries.erase(e.id);
}

void Scheduler::Impl::retire(Entry& e, FinishReason reason) {
  finished_reports.push_back({e.id, reason, e.generated});
  if (reason == FinishReason::Cancelled) {
    ++stats.cancelled;
  } else {
    ++stats.finished;
  }
  release(e);
}

void Scheduler::Impl::reject(Entry& e, std::string reason) {
  rejected_reports.push_back({e.id, "request " + std::to_string(e.id) + " can never run: " + std::move(reason)});
  ++stats.rejected;
  release(e);
}

void Scheduler::Impl::preempt(Entry& e, StepOutput& out) {
  ++e.preemptions;
  const bool alone = running.size() == 1;  // the only request in device memory
  running.erase(running.iterator_to(e));
  const BlockCounts held = cache.blocks_held(e.id);
  const BlockCounts host = cache.free_swap_slots();
  const bool swap = config.preemption == PreemptionMode::Swap && held[0] <= host[0] && held[1] <= host[1] &&
                    held[2] <= host[2];
  if (swap) {
    // Demotions may have changed its footprint since admission: a request
    // that can no longer complete in this cache ends here (as after a
    // recompute below) instead of holding host slots until it comes back
    // and fails again.
    e.plan = cache.plan(e.id);
    e.demand = cache.demand(e.prompt, e.plan);
    if (auto reason = never_fits(e)) {
      reject(e, *std::move(reason));
      return;
    }
    // Swapped out alone, it comes back into a cache that nothing else
    // changed. That is progress once (swap-in packs its blocks into as few
    // slabs as possible); a second time without a token generated in
    // between it is a livelock: the request cannot grow even alone.
    if (alone && e.lone_swap_at == e.generated) {
      reject(e, "it cannot store its next token even alone in the cache (" + std::to_string(e.num_tokens) +
                    " tokens held: " + counts_text(held) + " blocks; the whole cache holds " +
                    std::to_string(cache.total_slabs()) + " slabs), and swapping it out and in again changes nothing");
      return;
    }
    if (alone) e.lone_swap_at = e.generated;
    const std::vector<SwapCopy> copies = cache.swap_out(e.id);
    out.swap_out.insert(out.swap_out.end(), copies.begin(), copies.end());
    out.swapped_out.push_back(e.id);
    drop_slot(e);
    set_state(e, RequestState::Swapped);
    swapped.insert(e);
    ++stats.preempted_swap;
    return;
  }
  // Recompute: the prompt becomes the original plus every generated token
  // (as FP16 text); the plan keeps its demotions.
  e.plan = cache.plan(e.id);
  cache.free_sequence(e.id);
  drop_slot(e);
  std::vector<Segment> segments(e.original.segments().begin(), e.original.segments().end());
  if (e.generated > 0) {
    if (segments.back().kind == TokenKind::Text) {
      segments.back().length += e.generated;
    } else {
      segments.push_back({TokenKind::Text, e.generated});
    }
  }
  e.prompt = TokenLayout(std::move(segments));
  e.demand = cache.demand(e.prompt, e.plan);
  e.computed = 0;
  e.num_tokens = 0;
  set_state(e, RequestState::Waiting);
  out.preempted.push_back(e.id);
  ++stats.preempted_recompute;
  if (auto reason = never_fits(e)) {
    reject(e, *std::move(reason));
    return;
  }
  waiting.insert(e);
}

// FP16 blocks the decode batch could have once the demotions' target blocks
// `taken` are had and `freed` FP16 blocks are released: the largest r with
// can_allocate(taken + {r, 0, 0}), plus `freed` (the freed blocks sit in
// FP16 slabs, so after the demotions r + freed FP16 blocks can be had).
// -1 when `taken` itself cannot be had. Exact: the manager's own query,
// which counts slabs, not blocks.
std::int64_t Scheduler::Impl::fp16_room(const BlockCounts& taken, std::int64_t freed) const {
  if (!cache.can_allocate(taken)) return -1;
  std::int64_t lo = 0;               // can be had
  std::int64_t hi = fp16_limit + 1;  // cannot
  BlockCounts probe = taken;
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    probe[0] = taken[0] + mid;
    (cache.can_allocate(probe) ? lo : hi) = mid;
  }
  return lo + freed;
}

// Demotes windows of decoding requests, lowest similarity first across
// requests, in one manager call (so a step's demotions may run in any
// order), so that the decode batch's `need` FP16 blocks can be had, and if
// possible `target` (need plus the headroom):
//   1. FP16 windows to INT4: each frees one FP16 block, but its INT4 block
//      may take a slab (4 FP16 blocks' worth in a small cache);
//   2. once no FP16 window is left to demote, INT4 windows to INT2. These
//      free FP16 room only through the INT4 slabs they empty, and their
//      INT2 blocks must be had before any INT4 block is released.
// After each demotion the FP16 room it leaves is computed exactly in slabs
// (fp16_room; for step 2 plus the INT4 slabs emptied, following slab usage
// through KVCacheManager::used_in_slab and window_block). The kept prefix is
// the shortest that reaches `target`, else the one with the most room; a
// prefix is kept only when it leaves at least `need` and more room than
// there was: a demotion that costs a slab for less than a slab of relief is
// never made (it could leave a lone request unable to grow at all). With
// none kept, preemption follows. Never window 0, never text (neither is in
// demote_order).
void Scheduler::Impl::demote_for(std::int64_t need, std::int64_t target, const std::vector<Entry*>& decodes,
                                 StepOutput& out) {
  using Candidate = std::pair<float, Entry*>;
  auto later = [](const Candidate& a, const Candidate& b) {
    return std::tie(a.first, a.second->order) > std::tie(b.first, b.second->order);
  };
  using Heap = std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)>;
  const std::int64_t room_before = fp16_room({0, 0, 0}, 0);
  std::vector<Demotion> demotions;
  std::vector<std::int64_t> rooms;  // rooms[i]: FP16 room after demotions [0, i] (-1: targets not had)
  const auto limit = static_cast<std::size_t>(config.max_demotions_per_step);
  // One record per window looked at: a window whose demotions do not all
  // survive the cut below is looked at again in a later step.
  struct Looked {
    Entry* entry;
    std::size_t Entry::*cursor;
    std::size_t cursor_before;
    std::size_t end;  // demotions.size() after the window
  };
  std::vector<Looked> looked;
  // Each demoted request's footprint (footprint()) with its demotions so
  // far: a prefix that leaves one above the whole cache is not made, or the
  // request could no longer complete alone (a FP16 -> INT4 demotion that
  // lands in another request's INT4 slab gains room now and may cost this
  // request a slab of its own later). A single demotion may cross a slab
  // boundary that the rest of its window's demotions cross back, so this
  // is checked per prefix, not per demotion.
  boost::unordered_flat_map<const Entry*, BlockCounts> footprints;
  const std::int64_t total_slabs = cache.total_slabs();
  std::int64_t over = 0;               // requests whose footprint exceeds the cache now
  std::vector<std::uint8_t> in_cache;  // in_cache[i]: no footprint above the cache after demotions [0, i]
  // Room left by the demotions so far, -1 once their targets cannot be had.
  auto room = [&] { return rooms.empty() ? room_before : rooms.back(); };
  // Takes windows from a heap of each request's next candidate while the
  // room is short of `target`, the targets can be had and the per-step limit
  // allows: every layer of the window at `from` that can go to `to`.
  // room_after() gives the room once demotions.back() is made. True when no
  // candidate is left.
  auto take = [&](std::size_t Entry::*cursor, Precision from, Precision to, auto&& room_after) {
    Heap heap(later);
    for (Entry* e : decodes) {
      if (e->*cursor < e->demote_order.size()) heap.push({e->plan.score(e->demote_order[e->*cursor]), e});
    }
    auto more = [&] { return room() >= 0 && room() < target && demotions.size() < limit; };
    while (!heap.empty() && more()) {
      Entry* e = heap.top().second;
      heap.pop();
      const std::size_t before = e->*cursor;
      const std::int32_t window = e->demote_order[before];
      const PrecisionPlan& plan = cache.plan(e->id);
      auto [fp, fresh] = footprints.try_emplace(e);
      if (fresh) {
        fp->second = footprint(*e, plan);
        over += slabs_for(fp->second) > total_slabs ? 1 : 0;
      }
      std::int32_t layer = 0;
      for (; layer < num_layers && demotions.size() < limit; ++layer) {
        if (plan.at(layer, window) != from || below_floor(layer, to)) continue;
        if (cache.why_not_demotable(e->id, layer, window, to)) continue;
        const bool was_over = slabs_for(fp->second) > total_slabs;
        --fp->second[at(from)];
        ++fp->second[at(to)];
        over += (slabs_for(fp->second) > total_slabs ? 1 : 0) - (was_over ? 1 : 0);
        in_cache.push_back(over == 0 ? 1 : 0);
        demotions.push_back({e->id, layer, window, to});
        rooms.push_back(room_after());
      }
      // A window is done when all its layers were looked at; a later step
      // finishes one the per-step limit cut short.
      if (layer == num_layers) ++(e->*cursor);
      looked.push_back({e, cursor, before, demotions.size()});
      if (e->*cursor < e->demote_order.size()) heap.push({e->plan.score(e->demote_order[e->*cursor]), e});
    }
    return heap.empty();
  };

  // 1. FP16 -> INT4.
  const bool fp16_done = take(&Entry::demote_cursor, Precision::FP16, Precision::INT4, [&] {
    const auto n = static_cast<std::int64_t>(demotions.size());
    return fp16_room({0, n, 0}, n);
  });
  const auto to_int4 = static_cast<std::int64_t>(demotions.size());

  // 2. INT4 -> INT2: the room of the INT2 targets (exact) plus the INT4
  // slabs whose last used block goes. Step 1's INT4 targets fill partly used
  // INT4 slabs first, so up to to_int4 of the slabs counted as emptied that
  // had free blocks may receive one and stay in use: those are not counted.
  if (fp16_done && room() >= 0 && room() < target) {
    const PoolStats int4 = cache.pool_stats(Precision::INT4);
    const std::int64_t fp16_per_slab = cache.pool_stats(Precision::FP16).blocks_per_slab;
    boost::unordered_flat_map<std::int32_t, std::int32_t> used;  // INT4 slab -> used blocks left
    std::int64_t emptied_full = 0;     // emptied INT4 slabs that had no free block
    std::int64_t emptied_partial = 0;  // emptied INT4 slabs that had free blocks
    take(&Entry::int2_cursor, Precision::INT4, Precision::INT2, [&] {
      const Demotion& d = demotions.back();
      const std::int32_t slab = cache.window_block(d.id, d.layer, d.window) / int4.blocks_per_slab;
      auto [it, fresh] = used.try_emplace(slab, 0);
      if (fresh) it->second = cache.used_in_slab(Precision::INT4, slab);
      if (--it->second == 0) {
        (cache.used_in_slab(Precision::INT4, slab) == int4.blocks_per_slab ? emptied_full : emptied_partial) += 1;
      }
      const std::int64_t n = static_cast<std::int64_t>(demotions.size()) - to_int4;
      const std::int64_t r = fp16_room({0, to_int4, n}, to_int4);
      const std::int64_t emptied = emptied_full + std::max<std::int64_t>(emptied_partial - to_int4, 0);
      return r < 0 ? r : r + emptied * fp16_per_slab;
    });
  }

  // The prefix to make: the shortest that reaches `target`, else the one
  // with the most room; only one that leaves `need`, gains room and leaves
  // every request able to complete.
  std::size_t n = 0;
  std::int64_t best = room_before;
  for (std::size_t i = 0; i < rooms.size(); ++i) {
    if (in_cache[i] == 0 || rooms[i] < need || rooms[i] <= best) continue;
    n = i + 1;
    best = rooms[i];
    if (best >= target) break;
  }
  // Windows with a demotion cut off are looked at again later (in reverse,
  // so a request's cursor goes back to its first such window).
  for (auto it = looked.rbegin(); it != looked.rend(); ++it) {
    if (it->end > n) it->entry->*(it->cursor) = it->cursor_before;
  }
  if (n == 0) return;
  demotions.resize(n);
  const std::vector<DemoteOp> ops = cache.demote(demotions);
  out.demotions.insert(out.demotions.end(), ops.begin(), ops.end());
  stats.demotions += static_cast<std::int64_t>(ops.size());
  boost::unordered_flat_set<RequestId> changed;
  for (const Demotion& d : demotions) {
    if (changed.insert(d.id).second) out.tables_changed.push_back(d.id);
  }
}

// Makes room for `need` new FP16 blocks of the decode batch: demotion first
// (if enabled), then preemption of the lowest-ranked running requests.
void Scheduler::Impl::relieve(std::vector<Entry*>& decodes, std::int64_t& need, StepOutput& out) {
  if (demote_headroom > 0) demote_for(need, need + demote_headroom, decodes, out);
  while (!cache.can_allocate({need, 0, 0}) && !running.empty()) {
    Entry& victim = *std::prev(running.end());
    if (victim.state == RequestState::Running) {
      const auto it = std::find(decodes.begin(), decodes.end(), &victim);
      decodes.erase(it);
      if (victim.num_tokens % block_size == 0) need -= num_layers;
    }
    preempt(victim, out);
  }
}

void Scheduler::Impl::schedule_chunk(Entry& e, std::int32_t end, StepOutput& out) {
  PrefillChunk chunk;
  chunk.id = e.id;
  chunk.slot = e.slot;
  chunk.start = e.computed;
  chunk.end = end;
  chunk.last = end == e.prompt.num_tokens();
  out.num_batched_tokens += end - e.computed;
  stats.prefill_tokens += end - e.computed;
  e.computed = end;
  if (chunk.last) {
    set_state(e, RequestState::Running);
    ++e.generated;
    if (e.generated >= e.max_new_tokens) {
      e.done = true;
      done.push_back(&e);
    }
  }
  out.prefills.push_back(std::move(chunk));
}

// Full CSR of the decode batch, from the page tables the entries hold (no
// look-ups): O(blocks of the batch), the part of a step that grows with context.
void Scheduler::Impl::build_metadata(const std::vector<Entry*>& decodes, StepOutput& out) const {
  DecodeMetadata& meta = out.metadata;
  const std::size_t n = decodes.size();
  meta.batch_size = static_cast<std::int32_t>(n);
  meta.layers.resize(static_cast<std::size_t>(num_layers));
  std::vector<const PageTable*> tables;
  tables.reserve(n);
  for (const Entry* e : decodes) tables.push_back(e->table);
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    for (const Precision p : kAllPrecisions) {
      PagedPoolTable& t = meta.layers[static_cast<std::size_t>(layer)][at(p)];
      t.indptr.resize(n + 1);
      t.last_block_len.resize(n);
      std::int32_t total = 0;
      t.indptr[0] = 0;
      for (std::size_t i = 0; i < n; ++i) {
        total += static_cast<std::int32_t>(tables[i]->blocks(layer, p).size());
        t.indptr[i + 1] = total;
      }
      t.indices.resize(static_cast<std::size_t>(total));
      for (std::size_t i = 0; i < n; ++i) {
        const auto blocks = tables[i]->blocks(layer, p);
        std::copy(blocks.begin(), blocks.end(), t.indices.begin() + t.indptr[i]);
        const std::int32_t last = p == Precision::FP16 ? tables[i]->fp16_tail_fill(layer) : block_size;
        t.last_block_len[i] = blocks.empty() ? 0 : last;
      }
    }
  }
}

Scheduler::Scheduler(KVCacheManager& cache, SchedulerConfig config)
    : impl_(std::make_unique<Impl>(cache, std::move(config))) {}
Scheduler::~Scheduler() = default;

const SchedulerConfig& Scheduler::config() const { return impl_->config; }
const KVCacheManager& Scheduler::cache() const { return impl_->cache; }

void Scheduler::add_request(const Request& r) {
  Impl& s = *impl_;
  const std::string name = "request (id " + std::to_string(r.id) + ")";
  if (s.entries.contains(r.id)) {
    throw InvalidArgument("request.id = " + std::to_string(r.id) + " is a live request, expected a new id");
  }
  if (r.layout.num_tokens() < 1) {
    throw InvalidArgument(name + ": request.layout has 0 tokens, expected at least one segment");
  }
  if (r.max_new_tokens < 1) {
    throw InvalidArgument(name + ": request.max_new_tokens = " + std::to_string(r.max_new_tokens) +
                          ", expected >= 1");
  }
  if (!std::isfinite(r.arrival_time)) {
    throw InvalidArgument(name + ": request.arrival_time is not finite, expected a time on the engine's clock");
  }
  if (r.plan.has_value() == r.embeddings.has_value()) {
    throw InvalidArgument(name + ": request has " + (r.plan ? "both a plan and embeddings" : "neither plan nor embeddings") +
                          ", expected exactly one of request.plan and request.embeddings");
  }
  if (static_cast<std::int64_t>(r.layout.num_tokens()) + r.max_new_tokens > std::numeric_limits<std::int32_t>::max()) {
    throw InvalidArgument(name + ": request.max_new_tokens = " + std::to_string(r.max_new_tokens) +
                          " makes more than 2^31 - 1 tokens");
  }
  PrecisionPlan plan;
  if (r.embeddings) {
    if (!s.planner) {
      throw InvalidArgument(name + ": request.embeddings given but config.planner is not set, expected request.plan");
    }
    plan = s.planner->plan(r.layout, *r.embeddings);
  } else {
    plan = *r.plan;
  }
  BlockCounts demand{};
  try {
    demand = s.cache.demand(r.layout, plan);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(name + ": request." + e.what());
  }

  Entry& e = s.entries[r.id];
  e.id = r.id;
  e.neg_priority = s.config.policy == SchedulingPolicy::Priority ? -r.priority : 0;
  e.arrival = r.arrival_time;
  e.order = s.next_order++;
  e.original = r.layout;
  e.max_new_tokens = r.max_new_tokens;
  e.prompt = r.layout;
  e.plan = std::move(plan);
  e.demand = demand;
  e.window_starts = r.layout.window_starts(s.block_size);
  for (std::int32_t w = 1; w < e.plan.num_windows(); ++w) e.demote_order.push_back(w);
  std::stable_sort(e.demote_order.begin(), e.demote_order.end(),
                   [&](std::int32_t a, std::int32_t b) { return e.plan.score(a) < e.plan.score(b); });
  s.retired.erase(r.id);
  if (auto reason = s.never_fits(e)) {
    s.reject(e, *std::move(reason));
    return;
  }
  s.waiting.insert(e);
}

StepOutput Scheduler::step() {
  Impl& s = *impl_;
  StepOutput out;
  out.step = ++s.stats.steps;

  // Requests whose last token came out of the previous step.
  for (Entry* e : s.done) {
    if (e != nullptr) s.retire(*e, FinishReason::Length);
  }
  s.done.clear();

  std::int32_t budget = s.config.max_num_batched_tokens;

  // 1. Decodes: every running request past its prompt gets one token. One
  // pass over the entries finds the FP16 need and the batch; pressure
  // relief (rare) changes the batch and it is listed again.
  std::vector<Entry*> decodes = s.decoding;
  std::vector<SequenceHandle> handles;
  auto list_batch = [&] {
    const std::size_t n = decodes.size();
    out.decodes.resize(n);
    out.decode_slots.resize(n);
    handles.resize(n);
    std::int64_t opening = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const Entry* e = decodes[i];
      out.decodes[i] = e->id;
      out.decode_slots[i] = e->slot;
      handles[i] = e->handle;
      opening += e->num_tokens % s.block_size == 0 ? 1 : 0;  // every layer opens an FP16 block
    }
    return opening * s.num_layers;
  };
  std::int64_t need = list_batch();
  if (!s.cache.can_allocate({need + s.demote_headroom, 0, 0})) {
    s.relieve(decodes, need, out);
    need = list_batch();
  }
  out.append = s.cache.append_tokens(std::span<const SequenceHandle>(handles),
                                     s.config.per_layer_slots ? AppendSlots::PerLayer : AppendSlots::Compact);
  for (Entry* e : decodes) {
    ++e->num_tokens;
    ++e->generated;
    if (e->generated >= e->max_new_tokens) {
      e->done = true;
      s.done.push_back(e);
    }
  }
  budget -= static_cast<std::int32_t>(decodes.size());
  out.num_batched_tokens += static_cast<std::int32_t>(decodes.size());
  s.stats.decode_tokens += static_cast<std::int64_t>(decodes.size());

  // 2. Prompts already admitted go on, oldest first.
  for (auto it = s.running.begin(); s.prefilling > 0 && it != s.running.end();) {
    Entry& e = *it++;
    if (budget == 0) break;
    if (e.state != RequestState::Prefilling) continue;
    const std::int32_t end = s.chunk_end(e, budget);
    if (end == 0) continue;
    budget -= end - e.computed;
    s.schedule_chunk(e, end, out);
  }

  // 3. Swapped requests come back before new ones are admitted; nothing
  // comes in during a step that had to preempt (no preempt/resume thrash).
  const bool preempted = !out.preempted.empty() || !out.swapped_out.empty();
  auto room = [&] { return static_cast<std::int32_t>(s.running.size()) < s.config.max_num_seqs; };
  while (!preempted && !s.swapped.empty() && room()) {
    Entry& e = *s.swapped.begin();
    if (!s.fits(s.cache.blocks_held(e.id), true)) break;
    const std::vector<SwapCopy> copies = s.cache.swap_in(e.id);
    out.swap_in.insert(out.swap_in.end(), copies.begin(), copies.end());
    out.swapped_in.push_back(e.id);
    out.tables_changed.push_back(e.id);
    s.swapped.erase(s.swapped.iterator_to(e));
    s.set_state(e, e.computed == e.prompt.num_tokens() ? RequestState::Running : RequestState::Prefilling);
    e.table = &s.cache.page_table(e.id);
    s.take_slot(e);
    s.running.insert(e);
  }

  // 4. Admission with bounded look-ahead: the first waiting request that
  // does not fit lets up to `lookahead` others past it, for at most
  // max_head_bypass steps.
  if (!preempted && s.swapped.empty()) {
    Entry* blocked = nullptr;
    std::int32_t looked = 0;
    for (auto it = s.waiting.begin(); it != s.waiting.end() && room() && budget > 0;) {
      Entry& e = *it++;
      const std::int32_t end = s.chunk_end(e, budget);
      if (end != 0 && s.fits(e.demand, true)) {
        s.waiting.erase(s.waiting.iterator_to(e));
        s.cache.add_sequence(e.id, e.prompt, e.plan);
        e.handle = s.cache.handle(e.id);
        s.set_state(e, RequestState::Prefilling);
        e.num_tokens = e.prompt.num_tokens();
        e.table = &s.cache.page_table(e.id);
        s.take_slot(e);
        s.running.insert(e);
        out.tables_changed.push_back(e.id);
        budget -= end - e.computed;
        s.schedule_chunk(e, end, out);
        continue;
      }
      if (blocked == nullptr) {
        blocked = &e;
        if (++e.bypassed > s.config.max_head_bypass) break;  // drain: nothing past it
      }
      if (++looked > s.config.lookahead) break;
    }
  }

  // Slots of the prefill chunks' rows, per layer.
  for (PrefillChunk& chunk : out.prefills) {
    if (!s.config.build_mappings) break;
    chunk.mappings.resize(static_cast<std::size_t>(s.num_layers));
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      StoreMapping whole = s.cache.prefill_mapping(chunk.id, layer);
      StoreMapping& m = chunk.mappings[static_cast<std::size_t>(layer)];
      m.fp16_slots.assign(whole.fp16_slots.begin() + chunk.start, whole.fp16_slots.begin() + chunk.end);
      for (auto [windows, part] : {std::pair{&whole.int4_windows, &m.int4_windows},
                                   std::pair{&whole.int2_windows, &m.int2_windows}}) {
        for (const WindowSlot& w : *windows) {
          if (w.first_row >= chunk.start && w.first_row < chunk.end) part->push_back({w.block_id, w.first_row - chunk.start});
        }
      }
    }
  }

  if (s.config.build_metadata) s.build_metadata(decodes, out);
  s.last_decodes = out.decodes;
  out.finished = std::move(s.finished_reports);
  out.rejected = std::move(s.rejected_reports);
  s.finished_reports.clear();
  s.rejected_reports.clear();
  return out;
}

bool Scheduler::Impl::end_by_caller(RequestId id, FinishReason reason) {
  const auto it = entries.find(id);
  if (it == entries.end()) {
    if (retired.contains(id)) return false;
    throw UnknownId("id = " + std::to_string(id) + " was never added to this scheduler");
  }
  Entry& e = it->second;
  if (e.done) std::replace(done.begin(), done.end(), &e, static_cast<Entry*>(nullptr));
  retire(e, reason);
  return true;
}

bool Scheduler::finish(RequestId id) { return impl_->end_by_caller(id, FinishReason::Stopped); }

bool Scheduler::cancel(RequestId id) { return impl_->end_by_caller(id, FinishReason::Cancelled); }

bool Scheduler::contains(RequestId id) const { return impl_->entries.contains(id); }

RequestStatus Scheduler::status(RequestId id) const {
  const Entry& e = impl_->live(id, "id");
  return RequestStatus{e.state, e.prompt.num_tokens(), e.computed, e.generated, e.slot, e.preemptions};
}

SchedulerStats Scheduler::stats() const {
  const Impl& s = *impl_;
  SchedulerStats st = s.stats;
  st.waiting = static_cast<std::int32_t>(s.waiting.size());
  st.swapped = static_cast<std::int32_t>(s.swapped.size());
  st.running = 0;
  st.prefilling = 0;
  for (const Entry& e : s.running) (e.state == RequestState::Running ? st.running : st.prefilling) += 1;
  return st;
}

bool Scheduler::has_unfinished() const {
  const Impl& s = *impl_;
  return !s.entries.empty() || !s.finished_reports.empty() || !s.rejected_reports.empty();
}

std::array<PagedPoolTable, kNumPrecisions> Scheduler::layer_metadata(std::int32_t layer) const {
  const Impl& s = *impl_;
  if (layer < 0 || layer >= s.num_layers) {
    throw IndexOutOfRange("layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(s.num_layers));
  }
  std::array<PagedPoolTable, kNumPrecisions> tables;
  for (const Precision p : kAllPrecisions) {
    PagedPoolTable& t = tables[at(p)];
    t.indptr.push_back(0);
    for (const RequestId id : s.last_decodes) {
      const PageTable& table = s.cache.page_table(id);
      const auto blocks = table.blocks(layer, p);
      t.indices.insert(t.indices.end(), blocks.begin(), blocks.end());
      t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
      const std::int32_t last = p == Precision::FP16 ? table.fp16_tail_fill(layer) : s.block_size;
      t.last_block_len.push_back(blocks.empty() ? 0 : last);
    }
  }
  return tables;
}

void Scheduler::check_invariants() const {
  const Impl& s = *impl_;
  auto fail = [](const std::string& what) { throw InvariantViolation("scheduler: " + what); };
  s.cache.check_invariants();
  std::size_t in_queues = 0;
  std::size_t resident = 0;
  std::int32_t prefilling = 0;
  std::size_t decoding = 0;
  std::vector<std::uint8_t> slot_used(static_cast<std::size_t>(s.config.max_num_seqs), 0);
  auto check_queue = [&](const Queue& q, std::initializer_list<RequestState> states, const char* name) {
    for (const Entry& e : q) {
      ++in_queues;
      const std::string who = "request " + std::to_string(e.id) + " (" + std::string(to_string(e.state)) + ")";
      if (std::find(states.begin(), states.end(), e.state) == states.end()) fail(who + " is on the " + name + " queue");
      const auto it = s.entries.find(e.id);
      if (it == s.entries.end() || &it->second != &e) fail(who + " is queued but not a live entry");
      const bool on_device = e.state == RequestState::Prefilling || e.state == RequestState::Running;
      if (s.cache.contains(e.id) != (e.state != RequestState::Waiting)) fail(who + ": the cache disagrees on its memory");
      if (e.state == RequestState::Swapped && !s.cache.is_swapped(e.id)) fail(who + " is not swapped out in the cache");
      if (on_device) {
        ++resident;
        if (s.cache.is_swapped(e.id)) fail(who + " is swapped out in the cache");
        if (e.table != &s.cache.page_table(e.id)) fail(who + " holds a stale page table");
        if (e.num_tokens != s.cache.num_tokens(e.id)) {
          fail(who + " counts " + std::to_string(e.num_tokens) + " tokens, the cache " +
               std::to_string(s.cache.num_tokens(e.id)));
        }
        if (e.slot < 0 || e.slot >= s.config.max_num_seqs || slot_used[static_cast<std::size_t>(e.slot)]) {
          fail(who + " has slot " + std::to_string(e.slot) + ", out of range or shared");
        }
        slot_used[static_cast<std::size_t>(e.slot)] = 1;
      } else if (e.slot != -1) {
        fail(who + " holds slot " + std::to_string(e.slot) + " without device memory");
      }
      if (e.computed < 0 || e.computed > e.prompt.num_tokens()) fail(who + " computed " + std::to_string(e.computed));
      if (e.state == RequestState::Running && e.computed != e.prompt.num_tokens()) fail(who + " runs before its prompt is done");
      if (e.state == RequestState::Prefilling && e.computed == e.prompt.num_tokens()) fail(who + " prefills a done prompt");
      if (e.generated > e.max_new_tokens) fail(who + " generated more than max_new_tokens");
      const bool listed = e.decode_index >= 0 && static_cast<std::size_t>(e.decode_index) < s.decoding.size() &&
                          s.decoding[static_cast<std::size_t>(e.decode_index)] == &e;
      if (listed != (e.state == RequestState::Running)) fail(who + " is wrongly (un)listed for decoding");
      prefilling += e.state == RequestState::Prefilling ? 1 : 0;
      decoding += e.state == RequestState::Running ? 1 : 0;
    }
  };
  check_queue(s.waiting, {RequestState::Waiting}, "waiting");
  check_queue(s.running, {RequestState::Prefilling, RequestState::Running}, "running");
  check_queue(s.swapped, {RequestState::Swapped}, "swapped");
  if (prefilling != s.prefilling || decoding != s.decoding.size()) {
    fail("counts " + std::to_string(s.prefilling) + " prefilling and " + std::to_string(s.decoding.size()) +
         " decoding requests, the queues hold " + std::to_string(prefilling) + " and " + std::to_string(decoding));
  }
  if (in_queues != s.entries.size()) {
    fail(std::to_string(s.entries.size()) + " live requests but " + std::to_string(in_queues) + " queued");
  }
  if (s.cache.sequence_ids().size() != s.running.size() + s.swapped.size()) {
    fail("the cache holds " + std::to_string(s.cache.sequence_ids().size()) + " sequences, the scheduler " +
         std::to_string(s.running.size() + s.swapped.size()));
  }
  if (resident > static_cast<std::size_t>(s.config.max_num_seqs)) fail("more than max_num_seqs hold memory");
  if (s.free_slots.size() + resident != static_cast<std::size_t>(s.config.max_num_seqs)) {
    fail(std::to_string(s.free_slots.size()) + " free slots + " + std::to_string(resident) + " used != max_num_seqs");
  }
  for (const std::int32_t slot : s.free_slots) {
    if (slot < 0 || slot >= s.config.max_num_seqs || slot_used[static_cast<std::size_t>(slot)]) {
      fail("free slot " + std::to_string(slot) + " is out of range, used or listed twice");
    }
    slot_used[static_cast<std::size_t>(slot)] = 1;
  }
}

std::string Scheduler::describe_state() const {
  const Impl& s = *impl_;
  std::string out;
  auto queue = [&](const Queue& q, const char* name) {
    out += name;
    out += ":";
    // Plain += keeps GCC 12's -Wrestrict false positive on `" " + std::to_string(..)` away.
    for (const Entry& e : q) {
      out += ' ';
      out += std::to_string(e.id);
      out += '(';
      out += to_string(e.state);
      out += ' ';
      out += std::to_string(e.computed);
      out += '/';
      out += std::to_string(e.prompt.num_tokens());
      out += " gen ";
      out += std::to_string(e.generated);
      out += " slot ";
      out += std::to_string(e.slot);
      out += ')';
    }
    out += "\n";
  };
  queue(s.waiting, "waiting");
  queue(s.running, "running");
  queue(s.swapped, "swapped");
  return out + s.cache.describe_state();
}

}  // namespace mixkv
