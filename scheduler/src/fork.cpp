// Scheduler::fork and what forks cost a step: a forked request shares its
// parent's blocks, so its next token may copy a shared FP16 tail.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include <boost/unordered/unordered_flat_map.hpp>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::Entry;

bool Scheduler::Impl::tail_shared(const Entry& e) const {
  // Full tails (room 0) are never written again: the next token opens a
  // fresh block whether or not they are shared.
  if (e.table == nullptr || e.table->fp16_room() == 0) return false;
  for (const std::int32_t tail : e.table->fp16_tails()) {
    if (cache.ref_count(Precision::FP16, tail) > 1) return true;
  }
  return false;
}

std::int64_t Scheduler::Impl::tail_copies(const std::vector<Entry*>& decodes) const {
  boost::unordered_flat_map<std::int32_t, std::int32_t> holders;  // shared tail -> holders in the batch
  for (const Entry* e : decodes) {
    // A vanished sequence's table is gone; the append skips it anyway.
    if (!e->shares_tail || vanished(*e) || e->table->fp16_room() == 0) continue;
    for (const std::int32_t tail : e->table->fp16_tails()) {
      if (cache.ref_count(Precision::FP16, tail) > 1) ++holders[tail];
    }
  }
  std::int64_t copies = 0;
  for (const auto& [tail, n] : holders) copies += std::min(n, cache.ref_count(Precision::FP16, tail) - 1);
  return copies;
}

std::int64_t Scheduler::Impl::decode_need(const std::vector<Entry*>& decodes) const {
  std::int64_t opening = 0;
  bool sharing = false;
  for (const Entry* e : decodes) {
    opening += e->num_tokens % block_size == 0 ? 1 : 0;
    sharing = sharing || e->shares_tail;
  }
  return opening * num_layers + (sharing ? tail_copies(decodes) : 0);
}

void Scheduler::Impl::list_forked(StepOutput& out) {
  for (const RequestId id : forked) {
    const auto it = entries.find(id);
    // Cancelled since, or preempted in this step: no table to mirror.
    if (it == entries.end() || it->second.slot < 0) continue;
    if (std::find(out.tables_changed.begin(), out.tables_changed.end(), id) != out.tables_changed.end()) continue;
    out.tables_changed.push_back(id);
  }
  forked.clear();
}

void Scheduler::fork(RequestId parent, RequestId child, std::int32_t max_new_tokens) {
  Impl& s = *impl_;
  const std::string name = "fork(parent = " + std::to_string(parent) + ", child = " + std::to_string(child) + ")";
  Entry& p = s.live(parent, "parent");
  if (p.state != RequestState::Running) {
    throw InvalidArgument(name + ": parent is " + std::string(to_string(p.state)) +
                          ", expected a Running request (its prompt fully prefilled, in device memory)");
  }
  if (s.vanished(p)) {
    throw InvalidArgument(name + ": parent's sequence left the cache outside the scheduler, expected it in the cache");
  }
  if (p.drafts > 0) {
    throw InvalidArgument(name + ": parent has " + std::to_string(p.drafts) +
                          " draft tokens awaiting accept(), expected them accepted or rejected first");
  }
  if (p.exact) {
    // Its FP16 windows are to be demoted in place, which a shared block
    // never is: a child would pin the parent's windows at FP16.
    throw InvalidArgument(name +
                          ": parent's plan is pending (prefill_mode = Exact: its windows are still FP16, demoted "
                          "at a coming step), expected status(parent).plan_pending == false");
  }
  if (s.entries.contains(child)) {
    throw InvalidArgument(name + ": child = " + std::to_string(child) + " is a live request, expected a new id");
  }
  if (s.cache.contains(child)) {
    throw InvalidArgument(name + ": child = " + std::to_string(child) +
                          " is a sequence of the cache, expected an id the cache does not hold");
  }
  const std::int32_t remaining = p.max_new_tokens - p.generated;
  if (max_new_tokens == 0 || max_new_tokens < -1) {
    throw InvalidArgument(name + ": max_new_tokens = " + std::to_string(max_new_tokens) +
                          ", expected >= 1, or -1 for the parent's remaining tokens");
  }
  if (max_new_tokens == -1 && remaining < 1) {
    throw InvalidArgument(name + ": max_new_tokens = -1 takes the parent's remaining tokens, and the parent has " +
                          "generated all its " + std::to_string(p.max_new_tokens) + ", expected max_new_tokens >= 1");
  }
  const std::int32_t more = max_new_tokens == -1 ? remaining : max_new_tokens;
  if (std::int64_t{p.original.num_tokens()} + p.generated + more > std::numeric_limits<std::int32_t>::max()) {
    throw InvalidArgument(name + ": max_new_tokens = " + std::to_string(max_new_tokens) +
                          " makes more than 2^31 - 1 tokens");
  }
  if (s.running.size() >= static_cast<std::size_t>(s.config.max_num_seqs)) {
    throw OutOfMemory(name + ": no free page-table slot: " + std::to_string(s.running.size()) +
                      " requests hold device memory, config.max_num_seqs = " + std::to_string(s.config.max_num_seqs));
  }

  // The child's record, built aside (copying a hooked entry gives an
  // unlinked hook): the parent's prompt, plan and progress.
  Entry c = p;
  c.id = child;
  c.state = RequestState::Waiting;
  c.decode_index = -1;
  c.slot = -1;
  c.table = nullptr;
  c.done = false;
  c.max_new_tokens = p.generated + more;
  c.plan = s.cache.plan(parent);
  s.refresh_demand(c);
  c.preemptions = 0;
  c.bypassed = 0;
  c.lone_swap_at = -1;
  c.next_drafts = -1;
  if (auto reason = s.never_fits(c)) {
    throw InvalidArgument(name + ": max_new_tokens = " + std::to_string(max_new_tokens) + ": the child could never " +
                          "complete alone in this cache: " + *reason);
  }

  // Host memory first, then the cache, then only steps that cannot throw.
  s.decoding.reserve(s.decoding.size() + 1);
  s.forked.reserve(s.forked.size() + 1);
  Entry& e = s.entries.emplace(child, std::move(c)).first->second;
  try {
    s.cache.fork(parent, child);
  } catch (...) {
    s.entries.erase(child);
    throw;
  }
  e.handle = s.cache.handle(child);
  e.table = &s.cache.page_table(child);
  e.order = s.next_order++;
  s.retired.erase(child);
  s.take_slot(e);
  s.set_state(e, RequestState::Running);
  s.running.insert(e);
  p.shares_tail = true;
  e.shares_tail = true;
  s.forked.push_back(child);
  ++s.stats.forks;
}

}  // namespace mixkv
