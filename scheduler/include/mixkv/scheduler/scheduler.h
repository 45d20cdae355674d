#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/planner/plan_source.h"
#include "mixkv/scheduler/request.h"
#include "mixkv/scheduler/scheduler_config.h"
#include "mixkv/scheduler/step_output.h"

namespace mixkv {

namespace test {
struct SchedulerAccess;  // tests/scheduler/scheduler_access.h
}

// A request's progress.
struct RequestStatus {
  RequestState state = RequestState::Waiting;
  std::int32_t prompt_tokens = 0;    // of the prompt to prefill now (grows after a recompute)
  std::int32_t computed_tokens = 0;  // prompt rows computed so far
  std::int32_t generated = 0;        // tokens generated so far
  std::int32_t slot = -1;            // page-table slot while it holds device memory
  std::int32_t preemptions = 0;      // times preempted (recompute or swap)
  std::int32_t drafts = 0;           // draft tokens of the last step awaiting accept()
  // PrefillMode::Exact: the prompt is held FP16 and its plan not applied
  // yet (from admission until the plan's demotions are all made).
  bool plan_pending = false;
  // Prompt rows its last admission took from the prefix cache instead of
  // computing them (its first chunk started there).
  std::int32_t cached_tokens = 0;
};

struct SchedulerStats {
  std::int64_t steps = 0;
  std::int32_t waiting = 0;
  std::int32_t prefilling = 0;
  std::int32_t running = 0;
  std::int32_t swapped = 0;
  std::int64_t finished = 0;
  std::int64_t rejected = 0;
  std::int64_t cancelled = 0;  // by cancel(), and those whose sequence vanished
  std::int64_t vanished = 0;   // sequences that left the cache outside the scheduler
  std::int64_t preempted_recompute = 0;
  std::int64_t preempted_swap = 0;
  std::int64_t demotions = 0;  // (window, layer) demotions under memory pressure
  // PrefillMode::Exact: (window, layer) demotions that applied plans, and
  // the times (one per request and step) some of a request's waited for
  // target blocks the pools could not give.
  std::int64_t plan_demotions = 0;
  std::int64_t plan_waits = 0;
  // Age tiers: (window or stream block, layer) demotions made, and the
  // times (one per request and step) a request's waited for target blocks.
  std::int64_t age_demotions = 0;
  std::int64_t age_waits = 0;
  std::int64_t forks = 0;  // successful fork() calls
  std::int64_t decode_tokens = 0;
  std::int64_t prefill_tokens = 0;
  std::int64_t draft_tokens = 0;     // draft rows scheduled (speculative decoding)
  std::int64_t accepted_tokens = 0;  // of them, accepted (accept())
  // Prefix caching (CacheConfig::prefix_cache): admissions that shared
  // cached blocks, the prompt rows they took from the cache (not counted in
  // prefill_tokens), the blocks they shared, and the blocks the requests'
  // computed prompts gave the index.
  std::int64_t prefix_hits = 0;
  std::int64_t cached_prompt_tokens = 0;
  std::int64_t shared_blocks = 0;
  std::int64_t published_blocks = 0;
};

// The continuous-batching scheduler, driven one step at a time by a
// serving engine:
//
//   sched.add_request(r);               // whenever requests arrive
//   StepOutput out = sched.step();      // the batch of this step
//   ... engine applies out (step_output.h), runs the model, samples ...
//   sched.finish(id);                   // a request hit EOS
//
// Every step assumes the previous one was executed. Admission uses each
// request's exact per-pool block demand from its plan (all FP16 for a
// prompt prefilled in chunks under PrefillMode::Exact, demoted to the plan
// the step after its last chunk); the whole prompt is allocated at
// admission, prefill chunks only split the compute.
//
// With prefix caching (CacheConfig::prefix_cache) a request with
// token_keys is admitted by its demand after the blocks it shares with the
// cache (KVCacheManager::match_prefix; cached blocks no one holds count as
// free), its first chunk starts at the first row not cached
// (PrefillChunk::start, status().cached_tokens), and the rows each step
// computes are published to the cache at the next step (the engine has
// stored them by then), so they outlive the request. A prompt held FP16
// under PrefillMode::Exact shares nothing and publishes once its plan is
// applied. docs/scheduler.md, "Prefix caching".
//
// The scheduler drives `cache` (which must outlive it and start empty):
// while the scheduler lives, nothing else may add, free, append, swap or
// demote sequences there. Engines read it (pool_view, page tables).
//
// A request whose sequence vanishes from the cache all the same (another
// caller freed it, or freed it and added another sequence under its id)
// cannot go on: its KV memory is gone. check_invariants() reports the
// inconsistency until the next step(), which retires the request as
// finished with FinishReason::Cancelled and FinishedRequest::note saying
// why (what an engine does for an aborted request fits: stop sampling,
// return what was generated, hold nothing), counts it in stats().vanished,
// frees nothing of the cache (a sequence added under the id is not the
// scheduler's) and serves every other request as before. A request whose
// last token had already come out is reported as Length all the same, and
// cancel() or finish() of such a request succeed with the caller's reason.
//
// Every public call validates its input and throws the typed errors of
// mixkv/core/errors.h naming the argument; a call that throws changes
// nothing.
class Scheduler {
 public:
  // Plans for requests that come with embeddings are taken from `planner`
  // (make_cpu_plan_source, gpu::make_cuda_plan_source, or the engine's own),
  // or from a CPU planner built from config.planner; giving both is an
  // InvalidArgument naming them. Either way the source's config() must
  // match the cache (window_size == block_size, one sensitivity per layer,
  // min_precision empty or one per layer), and its min_precision floors
  // bind demotion under pressure (not the plans' own demotions after an
  // exact prefill). InvalidArgument naming the config field (prefill_mode =
  // Exact with a cache without fp16_windows_first too), or `cache` when it
  // holds sequences; config.planner itself is validated by WindowPlanner.
  Scheduler(KVCacheManager& cache, SchedulerConfig config, std::shared_ptr<PlanSource> planner = nullptr);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const SchedulerConfig& config() const;
  const KVCacheManager& cache() const;
  // Where plans come from (the given source, or the one config.planner
  // built); null when requests must bring their plans.
  std::shared_ptr<PlanSource> planner() const;

  // Queues a request. A request with neither plan nor embeddings (a text
  // prompt) is stored all FP16. InvalidArgument (naming request.<field>)
  // for a malformed one: an id that is live, an empty layout, both plan and
  // embeddings, a plan of the wrong shape, embeddings without a planner,
  // max_new_tokens < 1, token_keys neither empty nor one per prompt row. Embeddings are planned through the plan
  // source, whose errors pass through unchanged (nothing is queued); a
  // source that returns other than one plan of the layout's shape is an
  // InvalidArgument naming "the planner". A request that can never fit the
  // cache (or the token budget without chunking) is accepted and reported
  // in the next step's `rejected` with the reason.
  void add_request(const Request& request);

  // Schedules the next step (step_output.h).
  StepOutput step();

  // Parallel sampling and beam-like branching: `child` becomes a Running
  // request that shares every block of `parent` (KVCacheManager::fork, no
  // block allocated now) and decodes from the next step on. It has its own
  // page-table slot (listed in the next step's tables_changed), the
  // parent's generated count, priority and arrival time, and generates
  // `max_new_tokens` more tokens (-1: as many as the parent has left), so
  // status(child).generated and FinishedRequest::generated count the
  // parent's tokens before the fork too. The partly filled FP16 tail the
  // two share is copied on the next append (StepOutput::append.copies),
  // under the usual memory pressure policy. A forked request is served,
  // preempted and cancelled like any other: recompute prefills its prompt
  // plus its generated tokens as its own sequence; swap-out gives it
  // private copies; cancelling one leaves the others their shared blocks.
  // Errors (nothing changed): UnknownId for a parent that is not live;
  // InvalidArgument for a parent that is not Running (its prompt not fully
  // prefilled, or swapped out), has drafts awaiting accept() or its plan
  // pending (status().plan_pending: a shared window is never demoted), a child id
  // that is live (or held by the cache), max_new_tokens 0 or below -1, -1
  // for a parent with no token left, or a child that could never complete
  // alone in the cache;
  // OutOfMemory when max_num_seqs requests already hold device memory (no
  // free slot).
  void fork(RequestId parent, RequestId child, std::int32_t max_new_tokens = -1);

  // The engine ends a request (EOS, stop string): frees everything it holds,
  // in any state; reported in the next step's `finished` as Stopped.
  // UnknownId for an id never added; false (and nothing done) for a request
  // that has already left (finished, cancelled, rejected).
  bool finish(RequestId id);
  // Cancels a request in any state (waiting, prefilling, running, swapped):
  // frees everything it holds; reported in the next step's `finished` as
  // Cancelled. Idempotent: false for a request that has already left;
  // UnknownId for an id never added.
  bool cancel(RequestId id);

  // Speculative decoding (SchedulerConfig::num_speculative_tokens): the
  // draft tokens `id` asks for in its next decode step instead of the
  // config's default (capped the same way); the steps after use the default
  // again. UnknownId unless contains(id); InvalidArgument naming num_drafts
  // below 0.
  void speculate(RequestId id, std::int32_t num_drafts);
  // After verifying the last step's decode of `id`: its first num_accepted
  // drafts (0 .. status(id).drafts) were accepted. The rejected ones leave
  // the cache (KVCacheManager::truncate) and the step counts num_accepted
  // + 1 generated tokens (the accepted drafts, then the token sampled after
  // them, whose K/V the next step stores as its first row); a request that
  // reaches max_new_tokens so is reported finished by the next step. Drafts
  // not accepted before the next step() are all rejected there, as
  // accept(id, 0). Errors (nothing changed): UnknownId unless contains(id);
  // InvalidArgument for a request with no drafts awaiting acceptance (none
  // in the last step, or accepted already) or whose sequence left the
  // cache, and naming num_accepted outside 0 .. drafts.
  void accept(RequestId id, std::int32_t num_accepted);

  bool contains(RequestId id) const;  // live: added, and not finished, cancelled or rejected yet
  // A live request's progress; for one that ended since the last step (its
  // report comes in the next StepOutput) its last counts with state
  // Finished; UnknownId otherwise.
  RequestStatus status(RequestId id) const;
  SchedulerStats stats() const;
  bool has_unfinished() const;  // live requests or reports pending

  // CSR decode metadata of the last step's decode batch for one layer,
  // built on demand from the current page tables (valid until the next
  // call that changes the scheduler). IndexOutOfRange names "layer".
  std::array<PagedPoolTable, kNumPrecisions> layer_metadata(std::int32_t layer) const;

  // The manager's invariants plus the scheduler's own: every request in
  // exactly one queue matching its state, memory held exactly by Prefilling,
  // Running (device) and Swapped (host) requests, slots unique, running
  // sequences within max_num_seqs, a shared partly filled FP16 tail only
  // among requests marked as forked (the ones whose copies the decode need
  // counts), drafts awaiting accept() only on Running requests and within
  // max_new_tokens, and the plans: a compact request's manager plan at or
  // below its own, an exact one's all FP16 while it prefills, then above its
  // plan exactly where a demotion is pending (each one demotable). Throws
  // InvariantViolation.
  void check_invariants() const;
  // Canonical text of the scheduler's queues and the manager's state.
  std::string describe_state() const;

 private:
  friend struct test::SchedulerAccess;  // corrupts Impl to prove each invariant check can fail
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv
