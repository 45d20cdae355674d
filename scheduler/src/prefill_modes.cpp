// Prefill modes (SchedulerConfig::prefill_mode). Under Exact a prompt
// prefilled in several chunks is stored with every window FP16, so each
// chunk attends to FP16 keys; the step after its last chunk demotes its
// windows to the plan (docs/scheduler.md, "Prefill modes").
#include <algorithm>
#include <string>
#include <vector>

#include <boost/unordered/unordered_flat_set.hpp>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::at;
using scheduler_detail::counts_text;
using scheduler_detail::Entry;
using scheduler_detail::PlanDemotions;

namespace {

// `plan` with every window but window 0 FP16: what an exact prefill stores.
// Window 0 keeps its precision because demote() never moves it (the
// planner's plans hold it FP16 anyway).
PrecisionPlan exact_plan(const PrecisionPlan& plan) {
  PrecisionPlan fp16 = plan;
  for (std::int32_t layer = 0; layer < plan.num_layers(); ++layer) {
    for (std::int32_t w = 1; w < plan.num_windows(); ++w) fp16.set(layer, w, Precision::FP16);
  }
  return fp16;
}

}  // namespace

bool Scheduler::Impl::stores_fp16(const Entry& e, std::int32_t end) const {
  // One chunk reads no earlier chunk: storing it at its plan is exact too,
  // but under content identity its FP16 rows are what the cache keeps.
  return exact_mode() && (end < e.prompt.num_tokens() || content_keyed(e)) && e.fp16_demand != e.demand;
}

PrecisionPlan Scheduler::Impl::admitted_plan(const Entry& e) const { return e.exact ? exact_plan(e.plan) : e.plan; }

PrecisionPlan Scheduler::Impl::fp16_plan(const Entry& e) const { return exact_plan(e.plan); }

void Scheduler::Impl::refresh_demand(Entry& e) const {
  e.demand = cache.demand(e.prompt, e.plan);
  e.fp16_demand = exact_mode() ? cache.demand(e.prompt, exact_plan(e.plan)) : e.demand;
}

PrecisionPlan Scheduler::Impl::eventual_plan(const Entry& e) const {
  // Each window at the lower of the two: the manager's holds pressure
  // demotions, e.plan the plan demotions still pending.
  PrecisionPlan plan = e.plan;
  const PrecisionPlan& held = cache.plan(e.id);
  for (std::int32_t layer = 0; layer < plan.num_layers(); ++layer) {
    for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
      if (pool_index(held.at(layer, w)) > pool_index(plan.at(layer, w))) plan.set(layer, w, held.at(layer, w));
    }
  }
  return plan;
}

std::optional<std::string> Scheduler::Impl::fp16_never_fits(const Entry& e) const {
  // A prompt within one step's budget may still be admitted in one chunk,
  // at its plan; a longer one is always prefilled FP16.
  if (!exact_mode() || e.fp16_demand == e.demand || e.prompt.num_tokens() <= config.max_num_batched_tokens) {
    return std::nullopt;
  }
  // One slab beyond the FP16 prompt: the plan's demotions take their target
  // blocks before they release the FP16 ones.
  const std::int64_t slabs = slabs_for(e.fp16_demand) + 1;
  if (slabs <= cache.total_slabs()) return std::nullopt;
  return "prefill_mode = Exact stores its prompt of " + std::to_string(e.prompt.num_tokens()) +
         " tokens all FP16 while it is prefilled in chunks: " + counts_text(e.fp16_demand) +
         " blocks and one slab for the plan's demotions (" + std::to_string(slabs) + " slabs), the whole cache holds " +
         std::to_string(cache.total_slabs()) + " slabs";
}

void Scheduler::Impl::unplan(Entry& e) {
  if (e.exact && e.computed == e.prompt.num_tokens()) {
    const auto it = std::find(planning.begin(), planning.end(), &e);
    if (it != planning.end()) planning.erase(it);
  }
  e.exact = false;
}

// The pending demotions of the Running requests in `planning`, in order,
// while the pools can give their targets (can_allocate counts slabs
// exactly): the first that cannot be had ends the list for this step and
// every request left with some waits for a later one (the manager's demote
// is all or nothing). Requests whose sequence vanished are retired here:
// nothing may be demoted under an id that is no longer theirs.
void Scheduler::Impl::collect_plans(PlanDemotions& plans) {
  std::vector<Entry*> gone;
  for (Entry* e : planning) {
    if (e->state == RequestState::Running && vanished(*e)) gone.push_back(e);
  }
  for (Entry* e : gone) retire_vanished(*e);
  bool full = false;
  std::vector<Demotion> mine;
  std::vector<std::uint8_t> frees;  // [i]: mine[i] releases an FP16 block nobody else holds
  auto counts_of = [&](std::size_t n) {
    BlockCounts c = plans.taken;
    for (std::size_t i = 0; i < n; ++i) ++c[at(mine[i].target)];
    return c;
  };
  for (Entry* e : planning) {
    if (e->state != RequestState::Running) continue;  // swapped out: once it is back
    const PrecisionPlan& held = cache.plan(e->id);
    mine.clear();
    frees.clear();
    for (std::int32_t layer = 0; layer < num_layers; ++layer) {
      for (std::int32_t w = 1; w < held.num_windows(); ++w) {
        const Precision from = held.at(layer, w);
        const Precision to = e->plan.at(layer, w);
        if (pool_index(to) <= pool_index(from)) continue;
        // A window shared from the prefix cache: the request moves to its
        // own copy, the cache and other requests keep the FP16 one.
        mine.push_back({.id = e->id, .layer = layer, .window = w, .target = to, .leave_shared = content_prefix()});
        const bool alone = !content_prefix() || cache.ref_count(from, cache.window_block(e->id, layer, w)) == 1;
        frees.push_back(from == Precision::FP16 && alone ? 1 : 0);
      }
    }
    // The longest prefix of its demotions whose targets the pools give
    // beside those taken before: all at once when they fit, else by
    // bisection (can_allocate is monotone in the counts, and each call may
    // walk the cached blocks).
    std::size_t take = 0;
    if (!full && cache.can_allocate(counts_of(mine.size()))) {
      take = mine.size();
    } else if (!full) {
      std::size_t hi = mine.size();  // counts_of(hi) does not fit
      while (take + 1 < hi) {
        const std::size_t mid = take + (hi - take) / 2;
        (cache.can_allocate(counts_of(mid)) ? take : hi) = mid;
      }
      full = true;
    }
    plans.taken = counts_of(take);
    for (std::size_t i = 0; i < take; ++i) {
      plans.list.push_back(mine[i]);
      plans.freed += frees[i];
    }
    if (take == mine.size()) {
      plans.complete.push_back(e);
    } else {
      ++stats.plan_waits;
    }
  }
}

bool Scheduler::Impl::room_for(std::int64_t blocks, const PlanDemotions& plans) const {
  if (plans.list.empty()) return cache.can_allocate({blocks, 0, 0});
  // fp16_room(plans.taken, plans.freed) >= blocks in one call: the room is
  // monotone in the FP16 count, and each call may walk the cached blocks.
  BlockCounts probe = plans.taken;
  probe[0] += std::max<std::int64_t>(blocks - plans.freed, 0);
  return cache.can_allocate(probe);
}

// `demotions` holds plans.list first, then any pressure demotions: one
// manager call, so that no demotion's target is another's released source
// (the backends apply a step's demotions in any order).
void Scheduler::Impl::commit_demotions(const std::vector<Demotion>& demotions, const PlanDemotions& plans,
                                       StepOutput& out) {
  if (!demotions.empty()) {
    const std::vector<DemoteOp> ops = cache.demote(demotions);
    const auto forced = static_cast<std::int64_t>(plans.list.size());
    out.demotions.insert(out.demotions.end(), ops.begin(), ops.end());
    out.plan_demotions = static_cast<std::int32_t>(forced - plans.aged);
    out.age_demotions = static_cast<std::int32_t>(plans.aged);
    stats.plan_demotions += forced - plans.aged;
    stats.age_demotions += plans.aged;
    stats.demotions += static_cast<std::int64_t>(ops.size()) - forced;
    boost::unordered_flat_set<RequestId> changed;
    for (const Demotion& d : demotions) {
      if (changed.insert(d.id).second) out.tables_changed.push_back(d.id);
    }
  }
  for (const PlanDemotions::Advance& a : plans.advances) {
    a.entry->aged_stream = a.stream;
    a.entry->aged_window = a.window;
    a.entry->next_age_at = a.next_at;
  }
  for (Entry* e : plans.complete) {
    unplan(*e);
    // Its plan's demotions are stored once this step runs.
    if (prefix_caching() && !e->keys.empty()) publishing.push_back(e->id);
  }
}

void Scheduler::Impl::check_plan(const Entry& e, const std::string& who) const {
  auto fail = [&](const std::string& what) { throw InvariantViolation("scheduler: " + who + " " + what); };
  if (e.exact && !exact_mode()) fail("is marked exact under PrefillMode::Compact");
  const bool listed = std::find(planning.begin(), planning.end(), &e) != planning.end();
  const bool done = e.computed == e.prompt.num_tokens();
  if (listed != (e.exact && done)) {
    fail(std::string(listed ? "is" : "is not") + " listed as awaiting its plan's demotions (exact " +
         (e.exact ? "yes" : "no") + ", prompt " + (done ? "done" : "not done") + ")");
  }
  const PrecisionPlan& held = cache.plan(e.id);
  if (held.num_layers() != e.plan.num_layers() || held.num_windows() != e.plan.num_windows()) {
    fail("has a plan of another shape than the manager's");
  }
  std::int32_t pending = 0;
  for (std::int32_t layer = 0; layer < held.num_layers(); ++layer) {
    for (std::int32_t w = 0; w < held.num_windows(); ++w) {
      const Precision have = held.at(layer, w);
      const Precision want = e.plan.at(layer, w);
      const std::string where = " at layer " + std::to_string(layer) + " window " + std::to_string(w);
      // Content identity shares a cached window at the copy the plan wants.
      const bool cached = content_prefix() && e.window_starts[static_cast<std::size_t>(w)] + block_size <= e.cached;
      if (e.exact && !done && w > 0 && have != Precision::FP16 && !cached) {
        fail("prefills exact but the manager holds " + std::string(to_string(have)) + where);
      }
      if (pool_index(have) >= pool_index(want)) continue;
      if (!e.exact) {
        fail("is held at " + std::string(to_string(have)) + where + ", above its plan's " +
             std::string(to_string(want)));
      }
      ++pending;
      // What the next step's demote call will be given must be accepted.
      if (done && e.state == RequestState::Running) {
        if (auto reason = cache.why_not_demotable(e.id, layer, w, want, content_prefix()))
          fail("cannot apply its plan" + where + ": " + *reason);
      }
    }
  }
  if (e.exact && done && pending == 0) fail("awaits its plan's demotions but none is pending");
}

}  // namespace mixkv
