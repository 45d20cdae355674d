#pragma once
#include <cstdint>
#include <memory>

#include "mixkv/engine/backend.h"
#include "mixkv/planner/plan_source.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv {

// The chunk of batch-invariant decode that mixkv.Engine(batch_invariant=True)
// takes, in blocks: the one whose cost against the automatic split stays
// smallest at both ends of the decode matrix (at most 1.36x on an H200,
// batch 1 and 64; docs/kernels.md, "Batch-invariant decode").
inline constexpr std::int32_t kBatchInvariantBlocks = 32;

struct EngineConfig {
  CacheConfig cache;
  SchedulerConfig scheduler;
  std::int32_t num_q_heads = 0;
  BackendKind backend = BackendKind::CPU;
  std::int32_t cuda_device = 0;
  float sm_scale = 0.0f;                     // BackendConfig::sm_scale (0: 1/sqrt(head_dim))
  std::int32_t max_blocks_per_sequence = 0;  // BackendConfig::max_blocks_per_sequence (CUDA)
  // Batch-invariant decode: > 0 makes attend()'s output and LSE of a decode
  // bitwise the same whatever else is in the batch, in whatever order and
  // slot (under one config), by cutting its attention into chunks of this
  // many blocks of its own page lists alone (kBatchInvariantBlocks is the
  // usual choice); 0 = the automatic split, which looks at the whole batch.
  // Covers steps without drafts: a step with drafts runs every decode of
  // the batch through extend attention, split by the batch (docs/kernels.md,
  // "Batch-invariant decode"). The CPU backend is batch-invariant either
  // way. InvalidArgument naming it outside [0, 2^20].
  std::int32_t batch_invariant_blocks = 0;
};

// A serving engine's loop over mixkv: the scheduler and a backend. Each step
//   const StepOutput& s = engine.step();     // schedules and applies memory moves
//   for layer: engine.prefill(layer, q, k, v, out);  // rows of s.prefills, concatenated
//              (or engine.store(layer, k, v) after the engine's own attention)
//              engine.attend(layer, q, k, v, out);  // the batch s.decodes
//   then the engine samples, and calls finish()/cancel()/fork() as needed.
class Engine {
 public:
  // Throws InvalidArgument naming the field (scheduler and cache configs
  // as their owners check them; num_q_heads not a positive multiple of
  // num_kv_heads).
  explicit Engine(EngineConfig config, std::shared_ptr<PlanSource> planner = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineConfig& config() const;
  Scheduler& scheduler();
  const Scheduler& scheduler() const;
  Backend& backend();
  const KVCacheManager& cache() const;

  // A request with a plan, embeddings, or neither (FP16).
  void add_request(const Request& request);
  // Parallel sampling: `child` shares every block of the running `parent`.
  void fork(RequestId parent, RequestId child, std::int32_t max_new_tokens = -1);
  // Speculative decoding (Scheduler::speculate / accept): `id` gets
  // num_drafts draft rows in its next decode (step().decode_rows), and after
  // verifying them the engine reports how many were accepted; the rejected
  // ones leave the cache.
  void speculate(RequestId id, std::int32_t num_drafts);
  void accept(RequestId id, std::int32_t num_accepted);
  bool finish(RequestId id);
  bool cancel(RequestId id);
  bool has_unfinished() const;

  // The next step, its memory moves already applied by the backend. The
  // reference stays valid until the next step().
  const StepOutput& step();
  // store()/attend() check their arrays against that step (rows = the sum
  // of its chunks' lengths, batch = decodes.size(), dtype, device) and
  // throw InvalidArgument naming the argument, before any step too; then
  // the backend's checks and ops (backend.h).
  void store(std::int32_t layer, const TensorView& k, const TensorView& v);
  void attend(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const TensorView* lse = nullptr);
  // The step's prefill chunks attending through the cache, then stored
  // (Backend::prefill): q, out [rows, num_q_heads, head_dim], k, v [rows,
  // num_kv_heads, head_dim]. Per layer, prefill() or store(), not both.
  void prefill(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView* lse = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv
