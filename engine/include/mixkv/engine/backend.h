#pragma once
#include <cstdint>
#include <memory>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/tensor_view.h"
#include "mixkv/scheduler/step_output.h"

namespace mixkv {

class Scheduler;

enum class BackendKind : std::uint8_t { CPU = 0, CUDA = 1 };

// What a backend needs beyond the cache: the model's query heads (a multiple
// of the cache's KV heads, GQA) and the batch it must serve at most.
struct BackendConfig {
  CacheConfig cache;
  std::int32_t num_q_heads = 0;
  std::int32_t max_num_seqs = 256;    // decode batch and page-table slots (= SchedulerConfig::max_num_seqs)
  std::int32_t max_prefill_rows = 0;  // rows one step may store (= SchedulerConfig::max_num_batched_tokens)
  std::int32_t cuda_device = 0;       // CUDA backend only
  // Softmax scale of attend(); 0 = 1/sqrt(head_dim).
  float sm_scale = 0.0f;
  // CUDA backend: the longest page list of one (layer, pool) the device
  // tables hold; 0 = the most the arena can give one sequence (every layer
  // holds all of its tokens, so one layer's list is at most the arena's
  // largest pool's blocks / num_layers). A smaller bound saves device and
  // host memory (num_layers x 3 x max_num_seqs x bound ids); a step whose
  // tables exceed it is refused before anything is enqueued.
  std::int32_t max_blocks_per_sequence = 0;
  // Batch-invariant decode (EngineConfig::batch_invariant_blocks): > 0 cuts
  // every decode's attention into chunks of this many blocks of its own
  // page lists (gpu::DecodePlanConfig::batch_invariant_blocks), so that its
  // output does not depend on the rest of the batch; 0 = off. The CPU
  // backend's decode is batch-invariant either way and only checks it.
  std::int32_t batch_invariant_blocks = 0;
};

// One cache's KV memory and the ops over it, behind one interface for the
// CPU and the CUDA backend, so that an engine's step is the same code on
// both: apply() the scheduler's step, then per layer store() the prefill
// rows and attend() the decode batch. The backend owns the manager the
// scheduler drives (manager()).
//
// Order and streams: the CUDA backend enqueues everything on one stream
// (set_stream(), default: the legacy default stream) and never
// synchronizes inside a step; the CPU backend runs each call to completion.
// Every call validates its arrays and throws InvalidArgument naming the
// argument; a call that throws has changed nothing.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  virtual const BackendConfig& config() const = 0;
  virtual KVCacheManager& manager() = 0;
  virtual const KVCacheManager& manager() const = 0;

  // The memory moves of `step` in StepOutput's order (demotions, swap out,
  // swap in, copy-on-write copies), then (CUDA) the device page tables of
  // the decodes at step.decode_slots, and the decode plan of the batch. Must
  // be called once per step, before any store()/attend() of that step; what
  // they read is fixed here. The step is checked against the manager and
  // the config first (InvalidArgument naming the field, e.g. a batch over
  // max_num_seqs, prefill rows over max_prefill_rows, a decode that is not
  // in the manager); nothing is enqueued then. Decode metadata, prefill
  // mappings and per-layer slots come from the step when it carries them
  // (SchedulerConfig's build_metadata, build_mappings, per_layer_slots) and
  // from the manager's page tables otherwise, which is why the scheduler
  // itself is not read: the overload without one serves harnesses that
  // drive the manager and assemble steps themselves. With the scheduler, a
  // decode's device page table is read whole only when it is new to its
  // slot, listed in step.tables_changed or verified drafts last step, and
  // at its FP16 end otherwise (O(layers) a sequence); without one, every
  // decode's table is read whole.
  void apply(const StepOutput& step, const Scheduler& scheduler) { apply_step(step, &scheduler); }
  void apply(const StepOutput& step) { apply_step(step, nullptr); }

  // One layer's K and V of every prefill chunk of the step, rows
  // concatenated in step.prefills order: [rows, num_kv_heads, head_dim] of
  // the cache's 16-bit type.
  virtual void store(std::int32_t layer, const TensorView& k, const TensorView& v) = 0;

  // One layer of the step's prefill chunks with attention through the
  // cache (extend attention), so an engine keeps no copy of its own of a
  // prompt: each chunk's rows attend to every prompt row before the chunk
  // (stored by earlier steps, read at the precision it was stored in) and
  // causally to each other; then k and v are stored as store() stores them.
  //   q:   [rows, num_q_heads, head_dim], k, v: [rows, num_kv_heads,
  //        head_dim], rows of step.prefills concatenated (16-bit type)
  //   out: like q; lse: [rows, num_q_heads] float32 when given.
  // Per layer an engine calls prefill() or store(), not both.
  virtual void prefill(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView* lse) = 0;

  // One layer of the decode batch: appends k, v ([batch, num_kv_heads,
  // head_dim]) at the batch's slots, then attends q ([batch, num_q_heads,
  // head_dim]) over every pool, writing out ([batch, num_q_heads,
  // head_dim], the 16-bit type) and, when given, lse ([batch, num_q_heads]
  // float32, natural log). With drafts (step.decode_rows) every array has
  // decode_rows.back() rows instead, decode i's rows being its sampled
  // token then its drafts: each row attends to the sequence's earlier
  // tokens and causally to the rows of its decode (extend attention), so
  // one call verifies every draft.
  virtual void attend(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse) = 0;

  // CUDA: the stream the following calls enqueue on (a cudaStream_t);
  // ignored by the CPU backend.
  virtual void set_stream(void* stream) = 0;
  // Waits until every call made so far has finished (CPU: returns at once);
  // CUDA: then throws IndexOutOfRange for an id a kernel found out of range
  // (apply() checks the same, without waiting, before it starts).
  virtual void synchronize() = 0;

 protected:
  virtual void apply_step(const StepOutput& step, const Scheduler* scheduler) = 0;
};

// The CPU backend: host arena and swap buffer, the ops of mixkv/cpu/
// (CpuBackend::create in cpu_backend.h gives the same with its host bytes
// in reach).
std::unique_ptr<Backend> make_cpu_backend(const BackendConfig& config);
// The CUDA backend (kernels/): device arena, pinned swap buffer, device page
// tables, one decode plan a step. Throws InvalidArgument when mixkv was
// built without CUDA or no device is visible.
std::unique_ptr<Backend> make_cuda_backend(const BackendConfig& config);

}  // namespace mixkv
