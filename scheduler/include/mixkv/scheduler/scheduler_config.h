#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "mixkv/planner/window_planner.h"

namespace mixkv {

// Order in which waiting requests are admitted and running ones are kept.
enum class SchedulingPolicy : std::uint8_t {
  FCFS = 0,      // earliest arrival_time first (ties: order of add_request)
  Priority = 1,  // highest priority first, then FCFS
};

// What happens to a running request chosen as a victim under memory pressure.
enum class PreemptionMode : std::uint8_t {
  // Free its blocks and queue it again; its prompt plus the tokens it
  // generated are prefilled again later (generated tokens as FP16 text).
  Recompute = 0,
  // Copy its blocks to the host swap pool (CacheConfig::swap_blocks) and
  // bring them back later; falls back to Recompute when the host pool is full.
  Swap = 1,
};

// How a prompt prefilled in several chunks is stored while it is prefilled
// (docs/scheduler.md, "Prefill modes").
enum class PrefillMode : std::uint8_t {
  // Each window at its plan's precision as its chunk completes: later chunks
  // read earlier windows quantized. Admission reserves the plan's demand.
  Compact = 0,
  // Every window FP16 in every layer until the prompt is done, so every
  // chunk attends to FP16 keys (the prefill output equals unchunked dense
  // prefill); the step after the last chunk demotes the windows to the plan
  // (StepOutput::demotions, first plan_demotions of them). Admission
  // reserves the all-FP16 demand. A prompt prefilled in one chunk reads no
  // earlier chunk, so it is stored at its plan at once, as in Compact.
  // Needs CacheConfig::fp16_windows_first (only a window alone in its FP16
  // block can be demoted).
  Exact = 1,
};

// Age tiers (KIVI-style; docs/scheduler.md, "Age tiers"): a sequence keeps
// its first tokens (attention sinks) and its most recent tokens FP16 and
// demotes every older window, between steps, to a precision per layer.
// Windows are the plan's visual windows that it left FP16 and the full
// blocks of the FP16 stream (text, visual tails, generated tokens: every
// token outside visual windows, in order). A tier never raises a
// precision: a window the plan set to INT4 or INT2 is left as it is.
struct AgeTierPolicy {
  bool enabled = false;
  // A window holding any of the first sink_windows * block_size positions
  // stays FP16 (attention sinks: the first tokens draw large attention).
  std::int32_t sink_windows = 1;
  // A window is old once at least recent_windows * block_size tokens follow
  // it, so the recent_windows full windows before the partly filled last
  // one stay FP16. At least 1: the last full block stays FP16, so draft
  // tokens and the open tail are never demoted.
  std::int32_t recent_windows = 4;
  // The precision old windows get in each layer ([layer], e.g. from
  // measured sensitivity: FP16 keeps a layer's windows, INT4, INT2); empty:
  // INT4 in every layer. Raised to the planner's min_precision where that
  // is higher: the user's floors bind every demotion.
  std::vector<Precision> layer_floor;
};

struct SchedulerConfig {
  // Requests holding memory (prefilling + running) at most.
  std::int32_t max_num_seqs = 256;
  // Tokens one step may compute: one per decode plus the prefill chunks.
  // At least max_num_seqs and at least one window (block_size).
  std::int32_t max_num_batched_tokens = 8192;
  // Whether a prompt longer than the step's remaining budget is split into
  // chunks over several steps. Chunks end on window boundaries (a quantized
  // window is stored from all of its rows at once). Without chunking, a
  // prompt over max_num_batched_tokens is rejected.
  bool chunked_prefill = true;
  PrefillMode prefill_mode = PrefillMode::Compact;
  SchedulingPolicy policy = SchedulingPolicy::FCFS;
  // Fraction of the arena's slabs that admitting a request must leave
  // obtainable (as FP16 blocks), so that running requests can grow.
  double watermark = 0.01;
  // Under memory pressure, first demote the lowest-similarity FP16 windows
  // of running requests to INT4, then (once no FP16 window is left) INT4
  // windows to INT2 as far as that gives FP16 room; never window 0 or text,
  // never a layer below the plan source's min_precision. Preempt only when
  // that is not enough.
  bool demote_under_pressure = true;
  // Demotions (one window of one layer each) one step may make.
  std::int32_t max_demotions_per_step = 4096;
  PreemptionMode preemption = PreemptionMode::Recompute;
  // Bounded look-ahead: when the first waiting request does not fit now,
  // up to `lookahead` requests behind it may be admitted instead...
  std::int32_t lookahead = 8;
  // ...but only for max_head_bypass steps; after that, nothing is admitted
  // past it until it fits (so it cannot starve either).
  std::int32_t max_head_bypass = 64;
  // Build the full CSR decode metadata (every layer and pool) into each
  // StepOutput. Off, the engine reads the page tables incrementally
  // (Scheduler::layer_metadata builds one layer on demand). docs/scheduler.md
  // gives the cost of both.
  bool build_metadata = true;
  // Fill StepOutput::append.slots ([layer][i]: num_layers x batch entries a
  // step). Off, the step hands out only the compact form (append.offsets,
  // append.tails_changed and append.tail_blocks), O(batch) outside block
  // boundaries. docs/scheduler.md gives the cost of both.
  bool per_layer_slots = true;
  // Fill PrefillChunk::mappings. Off, an engine asks the cache
  // (KVCacheManager::prefill_mapping) itself; simulations skip them.
  bool build_mappings = true;
  // Speculative decoding: draft tokens a Running request gets in each decode
  // step (Scheduler::speculate() sets one request's next step instead); 0:
  // plain decoding. A decode with k drafts has 1 + k query rows, its last
  // sampled token and then the drafts, each stored like a decode token
  // (StepOutput::decode_rows); Scheduler::accept() takes the rejected ones
  // back after verification. Drafts are capped by the request's remaining
  // tokens (generated + 1 + k <= max_new_tokens), by the step's token budget
  // (in batch order) and by memory: a step never demotes or preempts for
  // drafts, it gives fewer (none in a step that relieved memory pressure).
  std::int32_t num_speculative_tokens = 0;
  // Plans requests that come with embeddings instead of a plan: the CPU
  // planner (make_cpu_plan_source) under this config. Any other source (the
  // GPU planner) is passed to the Scheduler's constructor instead; at most
  // one of the two.
  std::optional<PlannerConfig> planner;
  // Demotes old windows between steps (off by default). Needs the cache's
  // fp16_windows_first: a demoted window must fill exactly one FP16 block.
  AgeTierPolicy age_tiers;
};

}  // namespace mixkv
