// Prefix caching in the scheduler (CacheConfig::prefix_cache): admission by
// the demand after the blocks a request shares with the cache, its first
// chunk from the first row not cached, and the rows each step stores
// published to the cache at the next (docs/scheduler.md, "Prefix caching").
#include <algorithm>
#include <span>

#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::Admission;
using scheduler_detail::Entry;

namespace {

// The keys of the prompt rows that have them: a prompt prefilled again
// after a recompute ends in generated tokens, which have none.
std::span<const TokenKey> prompt_keys(const Entry& e) {
  return std::span<const TokenKey>(e.keys).first(
      std::min(e.keys.size(), static_cast<std::size_t>(e.prompt.num_tokens())));
}

}  // namespace

Admission Scheduler::Impl::admission(const Entry& e, std::int32_t budget) const {
  Admission a;
  if (prefix_caching() && !e.keys.empty()) {
    // By content a prompt is stored FP16 whatever it shares, and the shared
    // windows are taken for its plan (the FP16 copy to demote from, or the
    // plan's own copy).
    PrefixMatch match = content_keyed(e) ? cache.match_prefix(e.prompt, fp16_plan(e), prompt_keys(e), e.plan)
                                         : cache.match_prefix(e.prompt, e.plan, prompt_keys(e));
    if (match.rows > 0) {
      a.start = match.rows;
      a.match = std::move(match);
    }
  }
  a.end = chunk_end(e, budget, a.start);
  a.exact = a.end != 0 && stores_fp16(e, a.end);
  if (a.exact && a.match && !content_prefix()) {
    // Held FP16 so that every chunk reads FP16 keys: a cached prefix (at
    // its plan's precisions) would not be, and its shared windows could
    // not be demoted to the plan after.
    a.match.reset();
    a.start = 0;
    a.end = chunk_end(e, budget, 0);
    a.exact = a.end != 0 && stores_fp16(e, a.end);
  }
  a.demand = a.match ? a.match->demand : (a.exact ? e.fp16_demand : e.demand);
  return a;
}

void Scheduler::Impl::add_to_cache(Entry& e, const Admission& a) {
  if (!a.match) {
    cache.add_sequence(e.id, e.prompt, admitted_plan(e));
    e.cached = 0;
    return;
  }
  // The same call on the same state as admission()'s match: the same blocks.
  PrefixMatch got;
  if (content_keyed(e)) {
    got = cache.add_sequence(e.id, e.prompt, fp16_plan(e), prompt_keys(e), e.plan);
    // A window shared at a quantized copy stays there; one shared FP16 is
    // demoted to the plan after the prefill, or kept (PrefixHigher::Keep).
    const bool keep = cache.config().prefix_cache.higher == PrefixHigher::Keep;
    bool pending = false;
    for (std::int32_t layer = 0; layer < num_layers; ++layer) {
      for (std::int32_t w = 0; w < e.plan.num_windows(); ++w) {
        const Precision held = got.plan.at(layer, w);
        const bool shared = e.window_starts[static_cast<std::size_t>(w)] + block_size <= got.rows;
        // Window 0 is never demoted: it stays as shared.
        if (shared && (held != Precision::FP16 || keep || w == 0)) e.plan.set(layer, w, held);
        pending = pending || pool_index(e.plan.at(layer, w)) > pool_index(held);
      }
    }
    e.exact = e.exact && pending;
  } else {
    got = cache.add_sequence(e.id, e.prompt, e.plan, prompt_keys(e));
    e.plan = got.plan;  // windows shared at a higher precision stay there
  }
  refresh_demand(e);
  e.computed = got.rows;
  e.cached = got.rows;
  ++stats.prefix_hits;
  stats.cached_prompt_tokens += got.rows;
  stats.shared_blocks += got.shared[0] + got.shared[1] + got.shared[2];
}

// The engine ran the last step: the rows its chunks computed (and the
// windows its plan demotions wrote) are stored. A request that left or
// vanished since, or went out to the host, has nothing to give now.
void Scheduler::Impl::publish_stored() {
  for (const RequestId id : publishing) {
    const auto it = entries.find(id);
    if (it == entries.end()) continue;
    const Entry& e = it->second;
    const bool resident = e.state == RequestState::Prefilling || e.state == RequestState::Running;
    if (!resident || (e.exact && !content_prefix()) || vanished(e)) continue;
    const std::span<const TokenKey> keys = prompt_keys(e);
    stats.published_blocks +=
        cache.publish_prefix(e.id, keys.first(std::min(keys.size(), static_cast<std::size_t>(e.computed))));
  }
  publishing.clear();
}

}  // namespace mixkv
