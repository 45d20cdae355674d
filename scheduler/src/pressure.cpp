// Memory pressure: when the decode batch's FP16 growth cannot be had,
// demotion (lowest similarity first, exact in slabs) and then preemption
// of the lowest-ranked running requests (docs/scheduler.md, "One step").
#include <algorithm>
#include <iterator>
#include <queue>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/unordered/unordered_flat_map.hpp>

#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::at;
using scheduler_detail::counts_text;
using scheduler_detail::Entry;

void Scheduler::Impl::preempt(Entry& e, StepOutput& out) {
  ++e.preemptions;
  const bool alone = running.size() == 1;  // the only request in device memory
  running.erase(running.iterator_to(e));
  const BlockCounts held = cache.blocks_held(e.id);
  const BlockCounts host = cache.free_swap_slots();
  const bool swap =
      config.preemption == PreemptionMode::Swap && held[0] <= host[0] && held[1] <= host[1] && held[2] <= host[2];
  if (swap) {
    // Demotions may have changed its footprint since admission: a request
    // that can no longer complete in this cache ends here (as after a
    // recompute below) instead of holding host slots until it comes back
    // and fails again. Pending plan demotions wait until it is back.
    settle_plan(e);
    refresh_demand(e);
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
  // (as FP16 text); the plan keeps its demotions. An exact request is
  // prefilled FP16 again and demoted to that plan after it.
  settle_plan(e);
  unplan(e);
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
  refresh_demand(e);
  e.computed = 0;
  e.cached = 0;
  e.num_tokens = 0;
  reset_ages(e);  // its prompt is stored again, FP16 but for its plan
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
// demote_order), never a window whose plan demotion is pending.
//
// The step's plan demotions (`plans`, whose targets can be had) come first
// in the same manager call: every room above counts them (their targets
// taken, their FP16 sources freed), and "the room there was" is the room
// they leave. They are made whatever else is.
void Scheduler::Impl::demote_for(std::int64_t need, std::int64_t target, const std::vector<Entry*>& decodes,
                                 const PlanDemotions& plans, StepOutput& out) {
  using Candidate = std::pair<float, Entry*>;
  auto later = [](const Candidate& a, const Candidate& b) {
    return std::tie(a.first, a.second->order) > std::tie(b.first, b.second->order);
  };
  using Heap = std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)>;
  const std::size_t forced = plans.list.size();
  const std::int64_t p4 = plans.taken[at(Precision::INT4)];
  const std::int64_t p2 = plans.taken[at(Precision::INT2)];
  const std::int64_t room_before = fp16_room(plans.taken, plans.freed);
  std::vector<Demotion> demotions = plans.list;
  // Windows the step's age tiers demote already (the manager takes each
  // window once a call).
  std::set<std::tuple<RequestId, std::int32_t, std::int32_t>> aging;
  for (std::size_t i = forced - static_cast<std::size_t>(plans.aged); i < forced; ++i) {
    if (!plans.list[i].stream) aging.insert({plans.list[i].id, plans.list[i].layer, plans.list[i].window});
  }
  // rooms[i]: FP16 room after the plan demotions and pressure demotions
  // [0, i] (-1: targets not had).
  std::vector<std::int64_t> rooms;
  const auto limit = static_cast<std::size_t>(config.max_demotions_per_step);
  auto pressure = [&] { return demotions.size() - forced; };
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
    auto more = [&] { return room() >= 0 && room() < target && pressure() < limit; };
    while (!heap.empty() && more()) {
      Entry* e = heap.top().second;
      heap.pop();
      const std::size_t before = e->*cursor;
      const std::int32_t window = e->demote_order[before];
      const PrecisionPlan& plan = cache.plan(e->id);
      auto [fp, fresh] = footprints.try_emplace(e);
      if (fresh) {
        fp->second = footprint(*e, e->exact ? eventual_plan(*e) : plan);
        over += slabs_for(fp->second) > total_slabs ? 1 : 0;
      }
      std::int32_t layer = 0;
      bool shared = false;
      for (; layer < num_layers && pressure() < limit; ++layer) {
        if (plan.at(layer, window) != from || below_floor(layer, to) || plan_pending(*e, plan, layer, window) ||
            aging.contains({e->id, layer, window})) {
          continue;
        }
        if (cache.why_not_demotable(e->id, layer, window, to)) {
          const std::int32_t block = cache.window_block(e->id, layer, window);
          shared = shared || (block >= 0 && cache.ref_count(from, block) > 1);
          continue;
        }
        const bool was_over = slabs_for(fp->second) > total_slabs;
        --fp->second[at(from)];
        ++fp->second[at(to)];
        over += (slabs_for(fp->second) > total_slabs ? 1 : 0) - (was_over ? 1 : 0);
        in_cache.push_back(over == 0 ? 1 : 0);
        demotions.push_back({e->id, layer, window, to});
        rooms.push_back(room_after());
      }
      // A window is done when all its layers were looked at; a later step
      // finishes one the per-step limit cut short. A window shared with a
      // fork sibling becomes demotable once the siblings leave, so the
      // request's demotion stops there for this step and resumes there.
      if (layer == num_layers && !shared) ++(e->*cursor);
      looked.push_back({e, cursor, before, demotions.size()});
      if (!shared && e->*cursor < e->demote_order.size()) {
        heap.push({e->plan.score(e->demote_order[e->*cursor]), e});
      }
    }
    return heap.empty();
  };

  // 1. FP16 -> INT4.
  const bool fp16_done = take(&Entry::demote_cursor, Precision::FP16, Precision::INT4, [&] {
    const auto n = static_cast<std::int64_t>(pressure());
    return fp16_room({0, p4 + n, p2}, plans.freed + n);
  });
  const auto to_int4 = static_cast<std::int64_t>(pressure());

  // 2. INT4 -> INT2: the room of the INT2 targets (exact) plus the INT4
  // slabs whose last used block goes. Step 1's INT4 targets fill partly used
  // INT4 slabs first, so up to to_int4 of the slabs counted as emptied that
  // had free blocks may receive one and stay in use: those are not counted
  // (nor up to one a plan demotion's INT4 target).
  if (fp16_done && room() >= 0 && room() < target) {
    const PoolStats int4 = cache.pool_stats(Precision::INT4);
    const std::int64_t fp16_per_slab = cache.pool_stats(Precision::FP16).blocks_per_slab;
    boost::unordered_flat_map<std::int32_t, std::int32_t> used;  // INT4 slab -> used blocks left
    std::int64_t emptied_full = 0;                               // emptied INT4 slabs that had no free block
    std::int64_t emptied_partial = 0;                            // emptied INT4 slabs that had free blocks
    take(&Entry::int2_cursor, Precision::INT4, Precision::INT2, [&] {
      const Demotion& d = demotions.back();
      const std::int32_t slab = cache.window_block(d.id, d.layer, d.window) / int4.blocks_per_slab;
      auto [it, fresh] = used.try_emplace(slab, 0);
      if (fresh) it->second = cache.used_in_slab(Precision::INT4, slab);
      if (--it->second == 0) {
        (cache.used_in_slab(Precision::INT4, slab) == int4.blocks_per_slab ? emptied_full : emptied_partial) += 1;
      }
      const std::int64_t n = static_cast<std::int64_t>(pressure()) - to_int4;
      const std::int64_t r = fp16_room({0, p4 + to_int4, p2 + n}, plans.freed + to_int4);
      const std::int64_t emptied = emptied_full + std::max<std::int64_t>(emptied_partial - p4 - to_int4, 0);
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
    if (it->end > forced + n) it->entry->*(it->cursor) = it->cursor_before;
  }
  demotions.resize(forced + n);
  commit_demotions(demotions, plans, out);
}

// Makes room for `need` new FP16 blocks of the decode batch: the step's plan
// demotions and demotion (if enabled) first, then preemption of the
// lowest-ranked running requests.
void Scheduler::Impl::relieve(std::vector<Entry*>& decodes, std::int64_t& need, const PlanDemotions& plans,
                              StepOutput& out) {
  if (demote_headroom > 0) {
    demote_for(need, need + demote_headroom, decodes, plans, out);
  } else {
    commit_demotions(plans.list, plans, out);
  }
  while (!cache.can_allocate({need, 0, 0}) && !running.empty()) {
    Entry& victim = *std::prev(running.end());
    const bool decoding = victim.state == RequestState::Running;
    if (decoding) decodes.erase(std::find(decodes.begin(), decodes.end(), &victim));
    preempt(victim, out);
    // Its own new tails, and the copies of the tails it shared, are no
    // longer needed.
    if (decoding) need = decode_need(decodes);
  }
}

}  // namespace mixkv
