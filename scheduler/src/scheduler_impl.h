#pragma once
// The scheduler's private state, shared by its source files (scheduler.cpp:
// requests and steps; fork.cpp: forks; pressure.cpp: demotion and
// preemption; prefill_modes.cpp: exact prefill and the plans' demotions
// after it; speculative.cpp: draft tokens; metadata.cpp: CSR decode
// metadata; invariants.cpp: the checker) and by the tests'
// access hook (tests/scheduler/scheduler_access.h), which corrupts it to
// prove that every check can fail.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <boost/intrusive/set.hpp>
#include <boost/unordered/unordered_flat_map.hpp>
#include <boost/unordered/unordered_flat_set.hpp>
#include <boost/unordered_map.hpp>

#include "mixkv/planner/plan_source.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv {
namespace scheduler_detail {

using SetHook = boost::intrusive::set_member_hook<boost::intrusive::link_mode<boost::intrusive::safe_link>>;

inline std::size_t at(Precision p) { return static_cast<std::size_t>(pool_index(p)); }

// The scheduler's record of one live request.
struct Entry {
  // What a decode step touches, together at the front.
  SequenceHandle handle;        // while in the cache
  std::int32_t num_tokens = 0;  // tokens in the cache (prompt + appended decode tokens)
  std::int32_t generated = 0;   // tokens generated
  std::int32_t max_new_tokens = 1;
  std::int32_t slot = -1;
  std::int32_t decode_index = -1;  // position in Impl::decoding while Running
  RequestState state = RequestState::Waiting;
  bool done = false;  // generated max_new_tokens; retired at the next step
  // Set by fork() on parent and child: its partly filled FP16 tails may be
  // shared, so its next token may cost a copy (Impl::tail_copies). Cleared
  // after an append once its tails are private; an unset flag means private
  // tails (check_invariants), which keeps the decode need O(1) a request.
  bool shares_tail = false;
  // Speculative decoding: draft tokens in the cache awaiting accept() (set
  // for the step being scheduled, then until accept() or the next step),
  // and the drafts speculate() asked for the next decode (-1: the config's).
  std::int32_t drafts = 0;
  std::int32_t next_drafts = -1;
  RequestId id = 0;
  const PageTable* table = nullptr;  // while resident in device memory

  SetHook hook;  // in exactly one of waiting, running, swapped

  // Fixed at add_request: the queue key and the request's limits.
  std::int32_t neg_priority = 0;  // -priority under SchedulingPolicy::Priority, else 0
  double arrival = 0.0;
  std::int64_t order = 0;  // add_request order: the last tie-break
  TokenLayout original;

  // The prompt to prefill now: the original, plus the generated tokens as
  // text after a recompute. The plan follows the manager's after demotions
  // (Impl::settle_plan), except that a plan demotion still pending stays in
  // it: the plan is what the request's windows end up at.
  TokenLayout prompt;
  PrecisionPlan plan;
  BlockCounts demand{};       // cache.demand(prompt, plan)
  BlockCounts fp16_demand{};  // the same all FP16 (Exact; else == demand)
  // PrefillMode::Exact: admitted with every window but window 0 FP16 (a
  // prompt in several chunks). Set at admission, cleared once the plan's demotions are made
  // (or by a recompute); from the last chunk on it is in Impl::planning.
  bool exact = false;
  std::vector<std::int32_t> window_starts;  // of prompt (text adds no window)

  std::int32_t computed = 0;  // prompt rows computed
  // Prefix caching: the original prompt's content keys (Request::token_keys)
  // and the rows its last admission took from the cache.
  std::vector<TokenKey> keys;
  std::int32_t cached = 0;
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

  // Age tiers (age_tiers.cpp): stream blocks and visual windows (position
  // order) looked at so far, each demoted or left (sink, plan, shared), and
  // the token count at which the next one is old. Reset by a recompute.
  std::int32_t aged_stream = 0;
  std::int32_t aged_window = 0;
  std::int32_t next_age_at = 0;
};

struct KeyLess {
  bool operator()(const Entry& a, const Entry& b) const {
    return std::tie(a.neg_priority, a.arrival, a.order) < std::tie(b.neg_priority, b.arrival, b.order);
  }
};

using Queue = boost::intrusive::multiset<Entry, boost::intrusive::member_hook<Entry, SetHook, &Entry::hook>,
                                         boost::intrusive::compare<KeyLess>>;

// How a waiting request would be admitted now (Impl::admission): its first
// chunk's rows and storage, and the cached blocks it would share.
struct Admission {
  std::int32_t start = 0;            // first row to compute: the cached prefix's end
  std::int32_t end = 0;              // of the first chunk; 0 when none fits the budget
  bool exact = false;                // stored FP16 (PrefillMode::Exact)
  std::optional<PrefixMatch> match;  // a hit (rows > 0)
  BlockCounts demand{};              // blocks to allocate
};

// The demotions that apply plans in one step (Impl::collect_plans): the
// longest prefix of the pending ones, in planning order, whose target blocks
// the pools can give now.
struct PlanDemotions {
  std::vector<Demotion> list;
  std::vector<Entry*> complete;  // requests whose every pending demotion is in `list`
  BlockCounts taken{};           // target blocks of `list`
  std::int64_t freed = 0;        // FP16 blocks `list` releases
  // Age tiers (Impl::collect_ages): the last `aged` of `list` are age
  // demotions, and each request's cursors once they are made.
  struct Advance {
    Entry* entry;
    std::int32_t stream;
    std::int32_t window;
    std::int32_t next_at;
  };
  std::int64_t aged = 0;
  std::vector<Advance> advances;
};

inline std::string counts_text(const BlockCounts& c) {
  return "FP16 " + std::to_string(c[0]) + ", INT4 " + std::to_string(c[1]) + ", INT2 " + std::to_string(c[2]);
}

}  // namespace scheduler_detail

struct Scheduler::Impl {
  using Entry = scheduler_detail::Entry;
  using Queue = scheduler_detail::Queue;
  using PlanDemotions = scheduler_detail::PlanDemotions;
  using Admission = scheduler_detail::Admission;

  KVCacheManager& cache;
  SchedulerConfig config;
  // Plans requests that come with embeddings (null: none).
  std::shared_ptr<PlanSource> planner;
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
  // The last status of each request whose report is still pending (state
  // Finished), so that status() answers until step() reports it.
  boost::unordered_flat_map<RequestId, RequestStatus> reporting;
  std::vector<RequestId> last_decodes;
  std::vector<RequestId> forked;       // children since the last step, for tables_changed
  std::vector<RequestId> speculating;  // decoded with drafts in the last step
  // Prefix caching: requests whose stored rows grew in the last step (a
  // chunk computed, an exact plan applied), published at the next.
  std::vector<RequestId> publishing;
  // Exact requests past their last chunk whose plan demotions are pending,
  // in the order their prompts completed (Running ones demote, Swapped ones
  // wait until they are back).
  std::vector<Entry*> planning;
  std::int32_t overrides = 0;  // entries with next_drafts >= 0
  std::int64_t next_order = 0;
  SchedulerStats stats;

  Impl(KVCacheManager& c, SchedulerConfig cfg, std::shared_ptr<PlanSource> source);

  Entry& live(RequestId id, const char* name);
  BlockCounts footprint(const Entry& e, const PrecisionPlan& plan) const;
  std::int64_t slabs_for(const BlockCounts& blocks) const;
  std::optional<std::string> never_fits(const Entry& e) const;
  // End of a chunk of `e` from row `start` (e.computed, or a cached
  // prefix's end) within `budget` tokens.
  std::int32_t chunk_end(const Entry& e, std::int32_t budget, std::int32_t start) const;
  bool fits(const BlockCounts& blocks, bool with_reserve, const PrefixMatch* match = nullptr) const;

  void set_state(Entry& e, RequestState state);
  void take_slot(Entry& e);
  void drop_slot(Entry& e);
  void release(Entry& e);  // frees memory, unlinks, erases
  void retire(Entry& e, FinishReason reason);
  // finish() and cancel(): false for a request already retired.
  bool end_by_caller(RequestId id, FinishReason reason);
  void reject(Entry& e, std::string reason);

  // Whether the sequence the scheduler put in the cache for `e` (which holds
  // memory) is gone: freed, or freed and replaced under the same id.
  bool vanished(const Entry& e) const { return !cache.contains(e.id) || cache.handle(e.id) != e.handle; }
  // Retires `e`, whose sequence vanished, as Cancelled with a note.
  void retire_vanished(Entry& e);
  // Retires the vanished among the swapped and the prefilling requests, and
  // with `decodes` the Running ones, dropping them from `decodes` too.
  void sweep_vanished(std::vector<Entry*>* decodes);

  // Memory pressure (pressure.cpp).
  void preempt(Entry& e, StepOutput& out);
  // Makes room for `need` FP16 blocks; `plans` are made in the same manager
  // call as any pressure demotion (one demote call a step).
  void relieve(std::vector<Entry*>& decodes, std::int64_t& need, const PlanDemotions& plans, StepOutput& out);
  bool below_floor(std::int32_t layer, Precision to) const {
    return !floors.empty() && pool_index(to) > pool_index(floors[static_cast<std::size_t>(layer)]);
  }
  std::int64_t fp16_room(const BlockCounts& taken, std::int64_t freed) const;
  void demote_for(std::int64_t need, std::int64_t target, const std::vector<Entry*>& decodes,
                  const PlanDemotions& plans, StepOutput& out);

  // Prefill modes (prefill_modes.cpp), in order: whether `e`, admitted now
  // with a first chunk ending at `end`, is stored FP16; the manager's plan
  // for it; demand and fp16_demand from its prompt and plan; its plan merged
  // with the manager's (each window at the lower: pressure demotions kept,
  // pending plan demotions too), and e.plan set to that; why its FP16 prompt
  // can never fit; leaving Impl::planning (clears exact); the step's plan
  // demotions; whether `blocks` FP16 blocks can be had once they are made;
  // making them (and the pressure demotions after them in `demotions`) in
  // one manager call; the plans' invariants for `e`.
  bool exact_mode() const { return config.prefill_mode == PrefillMode::Exact; }
  bool stores_fp16(const Entry& e, std::int32_t end) const;
  PrecisionPlan admitted_plan(const Entry& e) const;
  // e.plan with every window but window 0 FP16: what an exact prefill stores.
  PrecisionPlan fp16_plan(const Entry& e) const;
  void refresh_demand(Entry& e) const;
  PrecisionPlan eventual_plan(const Entry& e) const;
  void settle_plan(Entry& e) const { e.plan = eventual_plan(e); }
  std::optional<std::string> fp16_never_fits(const Entry& e) const;
  void unplan(Entry& e);
  void collect_plans(PlanDemotions& plans);
  bool room_for(std::int64_t blocks, const PlanDemotions& plans) const;
  void commit_demotions(const std::vector<Demotion>& demotions, const PlanDemotions& plans, StepOutput& out);
  // Whether (layer, window) of `e`, whose manager plan is `held`, waits for
  // a plan demotion: pressure leaves it to the plan.
  static bool plan_pending(const Entry& e, const PrecisionPlan& held, std::int32_t layer, std::int32_t window) {
    return e.exact && pool_index(e.plan.at(layer, window)) > pool_index(held.at(layer, window));
  }
  void check_plan(const Entry& e, const std::string& who) const;

  // Age tiers (age_tiers.cpp): the precision old windows get in each layer
  // (empty: tiers off); the policy's checks; prompt position of stream token
  // `i` of `e`; the step's age demotions, after the plans' in `plans`, for
  // the Running requests with a window old enough and targets the pools can
  // give; the request's blocks at `tokens` tokens with every old window
  // demoted, and its largest footprint up to `end` tokens; the tiers'
  // invariants for `e`.
  std::vector<Precision> tiers;
  void configure_ages();
  std::int32_t stream_position(const Entry& e, std::int64_t i) const;
  void collect_ages(PlanDemotions& plans);
  BlockCounts aged_blocks(const Entry& e, const PrecisionPlan& plan, std::int64_t tokens) const;
  BlockCounts aged_footprint(const Entry& e, const PrecisionPlan& plan, std::int64_t end) const;
  void check_ages(const Entry& e, const std::string& who) const;
  static void reset_ages(Entry& e) {
    e.aged_stream = 0;
    e.aged_window = 0;
    e.next_age_at = 0;
  }

  // Forks (fork.cpp): whether a partly filled FP16 tail of `e` (resident,
  // not vanished) is shared; the FP16 blocks the copy-on-write of shared
  // tails costs the batch `decodes` (exactly what append_tokens takes: the
  // first ref - 1 holders of a shared tail in the batch copy it); the
  // decode need (new tails at block boundaries plus those copies); the
  // forked children still on the device, appended to out.tables_changed.
  bool tail_shared(const Entry& e) const;
  std::int64_t tail_copies(const std::vector<Entry*>& decodes) const;
  std::int64_t decode_need(const std::vector<Entry*>& decodes) const;
  void list_forked(StepOutput& out);

  // Speculative decoding (speculative.cpp): whether a step may give drafts;
  // the drafts of the batch `decodes` (Entry::drafts) under the step's
  // budget and memory, true when some has any (`relieved`: the step relieved
  // memory pressure, none then); the append's counts; after the append, the
  // token counts and decode_rows, returning the draft rows; the drafts the
  // last step left unaccepted rejected; drafts of `e` dropped down to
  // `accepted`.
  bool wants_drafts() const { return config.num_speculative_tokens > 0 || overrides > 0; }
  bool assign_drafts(const std::vector<Entry*>& decodes, std::int64_t need, bool relieved);
  std::vector<std::int32_t> draft_counts(const std::vector<Entry*>& decodes) const;
  std::int32_t commit_drafts(const std::vector<Entry*>& decodes, StepOutput& out);
  void reject_drafts();
  void settle_drafts(Entry& e, std::int32_t accepted);

  // Prefix caching (prefix_hits.cpp): whether the cache has it; how `e`
  // would be admitted with `budget` tokens; admitting it so (its sequence
  // added, sharing the match's blocks); publishing the rows the last step
  // stored.
  bool prefix_caching() const { return cache.config().prefix_cache.enabled; }
  // Prefix caching by content (PrefixIdentity::Content): keyed prompts are
  // stored FP16, published, then demoted to their plans.
  bool content_prefix() const {
    return prefix_caching() && cache.config().prefix_cache.identity == PrefixIdentity::Content;
  }
  bool content_keyed(const Entry& e) const { return content_prefix() && !e.keys.empty(); }
  Admission admission(const Entry& e, std::int32_t budget) const;
  void add_to_cache(Entry& e, const Admission& a);
  void publish_stored();

  void schedule_chunk(Entry& e, std::int32_t end, StepOutput& out);
  void build_metadata(const std::vector<Entry*>& decodes, StepOutput& out) const;  // metadata.cpp
};

}  // namespace mixkv
