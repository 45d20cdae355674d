#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/scheduler/request.h"
#include "mixkv/scheduler/scheduler_config.h"
#include "mixkv/scheduler/step_output.h"

namespace mixkv {

// A request's progress.
struct RequestStatus {
  RequestState state = RequestState::Waiting;
  std::int32_t prompt_tokens = 0;    // of the prompt to prefill now (grows after a recompute)
  std::int32_t computed_tokens = 0;  // prompt rows computed so far
  std::int32_t generated = 0;        // tokens generated so far
  std::int32_t slot = -1;            // page-table slot while it holds device memory
  std::int32_t preemptions = 0;      // times preempted (recompute or swap)
};

struct SchedulerStats {
  std::int64_t steps = 0;
  std::int32_t waiting = 0;
  std::int32_t prefilling = 0;
  std::int32_t running = 0;
  std::int32_t swapped = 0;
  std::int64_t finished = 0;
  std::int64_t rejected = 0;
  std::int64_t cancelled = 0;
  std::int64_t preempted_recompute = 0;
  std::int64_t preempted_swap = 0;
  std::int64_t demotions = 0;  // (window, layer) demotions
  std::int64_t decode_tokens = 0;
  std::int64_t prefill_tokens = 0;
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
// request's exact per-pool block demand from its plan; the whole prompt is
// allocated at admission, prefill chunks only split the compute.
//
// The scheduler drives `cache` (which must outlive it and start empty):
// while the scheduler lives, nothing else may add, free, append, swap or
// demote sequences there. Engines read it (pool_view, page tables).
//
// Every public call validates its input and throws the typed errors of
// cache/errors.h naming the argument; a call that throws changes nothing.
class Scheduler {
 public:
  // InvalidArgument naming the config field, or `cache` when it holds
  // sequences; the planner config is validated by WindowPlanner.
  Scheduler(KVCacheManager& cache, SchedulerConfig config);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const SchedulerConfig& config() const;
  const KVCacheManager& cache() const;

  // Queues a request. InvalidArgument (naming request.<field>) for a
  // malformed one: an id that is live, an empty layout, both or neither of
  // plan/embeddings, a plan of the wrong shape, embeddings without a
  // planner, max_new_tokens < 1. A request that can never fit the cache (or
  // the token budget without chunking) is accepted and reported in the
  // next step's `rejected` with the reason.
  void add_request(const Request& request);

  // Schedules the next step (step_output.h).
  StepOutput step();

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

  bool contains(RequestId id) const;  // live: not yet reported as finished or rejected
  RequestStatus status(RequestId id) const;  // UnknownId unless contains(id)
  SchedulerStats stats() const;
  bool has_unfinished() const;  // live requests or reports pending

  // CSR decode metadata of the last step's decode batch for one layer,
  // built on demand from the current page tables (valid until the next
  // call that changes the scheduler). IndexOutOfRange names "layer".
  std::array<PagedPoolTable, kNumPrecisions> layer_metadata(std::int32_t layer) const;

  // The manager's invariants plus the scheduler's own: every request in
  // exactly one queue matching its state, memory held exactly by Prefilling,
  // Running (device) and Swapped (host) requests, slots unique, running
  // sequences within max_num_seqs. Throws InvariantViolation.
  void check_invariants() const;
  // Canonical text of the scheduler's queues and the manager's state.
  std::string describe_state() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv
