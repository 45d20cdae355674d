#pragma once
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv {

// A request is the sequence of the same id in the KVCacheManager while it
// holds memory.
using RequestId = SequenceId;

// What a serving engine hands the scheduler for one generation request.
struct Request {
  RequestId id = 0;
  // The prompt: e.g. (system text, visual tokens of the video, question).
  TokenLayout layout;
  // At most one of the two: the WindowQuant plan of the prompt, or its
  // embeddings ([layout.num_tokens(), hidden], read only during
  // add_request()) for the scheduler's plan source (its constructor's
  // `planner`, or SchedulerConfig::planner) to plan from. With neither, the
  // prompt is stored all FP16 (every window of every layer, scores 0): what
  // a text prompt means, and the safe choice for visual tokens nobody
  // planned.
  std::optional<PrecisionPlan> plan;
  std::optional<EmbeddingsView> embeddings;
  // Prefix caching (CacheConfig::prefix_cache): each prompt row's content
  // key (TokenKey: the token id of a text token, the engine's 64-bit hash
  // of a visual token's embedding), layout.num_tokens() of them; empty: the
  // request neither shares nor publishes cached blocks.
  std::vector<TokenKey> token_keys;
  std::int32_t max_new_tokens = 1;  // >= 1; the first comes out of the prefill
  std::int32_t priority = 0;        // larger is more urgent (SchedulingPolicy::Priority)
  double arrival_time = 0.0;        // engine clock; earlier is served first
};

// Where a request stands. Waiting requests hold no memory; Prefilling and
// Running ones hold their whole prompt (and generated tokens) in the device
// pools; Swapped ones hold host swap slots.
enum class RequestState : std::uint8_t {
  Waiting = 0,     // queued, or preempted by recompute and queued again
  Prefilling = 1,  // admitted; prompt chunks still to compute
  Running = 2,     // decoding one token per step
  Swapped = 3,     // preempted to the host swap pool
  Finished = 4,    // done (reported once in StepOutput::finished), or rejected
};

enum class FinishReason : std::uint8_t {
  Length = 0,     // generated max_new_tokens
  Stopped = 1,    // the engine called Scheduler::finish() (EOS, stop string)
  Cancelled = 2,  // Scheduler::cancel()
};

constexpr std::string_view to_string(RequestState s) {
  switch (s) {
    case RequestState::Waiting: return "Waiting";
    case RequestState::Prefilling: return "Prefilling";
    case RequestState::Running: return "Running";
    case RequestState::Swapped: return "Swapped";
    case RequestState::Finished: return "Finished";
  }
  return "?";
}

constexpr std::string_view to_string(FinishReason r) {
  switch (r) {
    case FinishReason::Length: return "Length";
    case FinishReason::Stopped: return "Stopped";
    case FinishReason::Cancelled: return "Cancelled";
  }
  return "?";
}

}  // namespace mixkv
