// Scheduler::check_invariants and describe_state: the scheduler's
// bookkeeping held against itself and against the manager's.
#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::Entry;
using scheduler_detail::Queue;

void Scheduler::check_invariants() const {
  const Impl& s = *impl_;
  auto fail = [](const std::string& what) { throw InvariantViolation("scheduler: " + what); };
  s.cache.check_invariants();
  std::size_t in_queues = 0;
  std::size_t resident = 0;
  std::int32_t prefilling = 0;
  std::size_t decoding = 0;
  std::int32_t overrides = 0;
  // Checked before the slots: with more requests than slots, some slot is
  // out of range or shared, which would hide the excess.
  if (s.running.size() > static_cast<std::size_t>(s.config.max_num_seqs)) {
    fail(std::to_string(s.running.size()) +
         " requests hold device memory, more than max_num_seqs = " + std::to_string(s.config.max_num_seqs));
  }
  std::vector<std::uint8_t> slot_used(static_cast<std::size_t>(s.config.max_num_seqs), 0);
  auto check_queue = [&](const Queue& q, std::initializer_list<RequestState> states, const char* name) {
    for (const Entry& e : q) {
      ++in_queues;
      const std::string who = "request " + std::to_string(e.id) + " (" + std::string(to_string(e.state)) + ")";
      if (std::find(states.begin(), states.end(), e.state) == states.end()) fail(who + " is on the " + name + " queue");
      const auto it = s.entries.find(e.id);
      if (it == s.entries.end() || &it->second != &e) fail(who + " is queued but not a live entry");
      const bool on_device = e.state == RequestState::Prefilling || e.state == RequestState::Running;
      if (s.cache.contains(e.id) != (e.state != RequestState::Waiting))
        fail(who + ": the cache disagrees on its memory");
      if (e.state == RequestState::Swapped && !s.cache.is_swapped(e.id)) fail(who + " is not swapped out in the cache");
      if (on_device) {
        ++resident;
        if (s.cache.is_swapped(e.id)) fail(who + " is swapped out in the cache");
        if (e.table != &s.cache.page_table(e.id)) fail(who + " holds a stale page table");
        if (e.num_tokens != s.cache.num_tokens(e.id)) {
          fail(who + " counts " + std::to_string(e.num_tokens) + " tokens, the cache " +
               std::to_string(s.cache.num_tokens(e.id)));
        }
        // The decode need counts copy-on-write copies only for marked requests.
        if (!e.shares_tail && s.tail_shared(e)) {
          fail(who + " shares a partly filled FP16 tail but is not marked as forked");
        }
        if (e.slot < 0 || e.slot >= s.config.max_num_seqs || slot_used[static_cast<std::size_t>(e.slot)]) {
          fail(who + " has slot " + std::to_string(e.slot) + ", out of range or shared");
        }
        slot_used[static_cast<std::size_t>(e.slot)] = 1;
      } else if (e.slot != -1) {
        fail(who + " holds slot " + std::to_string(e.slot) + " without device memory");
      }
      if (e.computed < 0 || e.computed > e.prompt.num_tokens()) fail(who + " computed " + std::to_string(e.computed));
      // Rows taken from the prefix cache are part of what is computed, and
      // only memory holds them.
      if (e.cached < 0 || e.cached > e.computed || (e.cached > 0 && e.state == RequestState::Waiting)) {
        fail(who + " took " + std::to_string(e.cached) + " rows from the prefix cache, " + std::to_string(e.computed) +
             " computed");
      }
      if (e.state == RequestState::Running && e.computed != e.prompt.num_tokens())
        fail(who + " runs before its prompt is done");
      if (e.state == RequestState::Prefilling && e.computed == e.prompt.num_tokens())
        fail(who + " prefills a done prompt");
      if (e.generated > e.max_new_tokens) fail(who + " generated more than max_new_tokens");
      // Drafts stay in the cache only between a step and accept().
      if (e.drafts < 0 ||
          (e.drafts > 0 && (e.state != RequestState::Running || e.done || e.generated + e.drafts > e.max_new_tokens))) {
        fail(who + " holds " + std::to_string(e.drafts) + " drafts awaiting accept() after generating " +
             std::to_string(e.generated) + " of " + std::to_string(e.max_new_tokens) + " tokens");
      }
      if (e.state == RequestState::Waiting) {
        if (e.exact) fail(who + " is marked exact without memory");
      } else {
        s.check_plan(e, who);  // prefill_modes.cpp
      }
      s.check_ages(e, who);  // age_tiers.cpp
      overrides += e.next_drafts >= 0 ? 1 : 0;
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
  if (overrides != s.overrides) {
    fail("counts " + std::to_string(s.overrides) + " requests with drafts set by speculate(), the queues hold " +
         std::to_string(overrides));
  }
  std::size_t planning = 0;
  for (const auto& [id, e] : s.entries) planning += e.exact && e.computed == e.prompt.num_tokens() ? 1 : 0;
  if (planning != s.planning.size()) {
    fail("lists " + std::to_string(s.planning.size()) + " requests awaiting their plan's demotions, the entries " +
         std::to_string(planning));
  }
  if (in_queues != s.entries.size()) {
    fail(std::to_string(s.entries.size()) + " live requests but " + std::to_string(in_queues) + " queued");
  }
  if (s.cache.sequence_ids().size() != s.running.size() + s.swapped.size()) {
    fail("the cache holds " + std::to_string(s.cache.sequence_ids().size()) + " sequences, the scheduler " +
         std::to_string(s.running.size() + s.swapped.size()));
  }
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
      if (e.drafts > 0) {
        out += " drafts ";
        out += std::to_string(e.drafts);
      }
      if (e.exact) out += " exact";
      if (e.cached > 0) {
        out += " cached ";
        out += std::to_string(e.cached);
      }
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
