#pragma once
// Tiny caches, requests with hand-made plans and a base configuration for
// the scheduler tests.
#include <cstdint>
#include <utility>
#include <vector>

#include "mixkv/scheduler/scheduler.h"

namespace mixkv::test {

// 2 layers, 1 KV head, head_dim 16, block_size 16; 4 KiB slabs: 4 FP16,
// 10 INT4 or 16 INT2 blocks.
inline CacheConfig tiny(std::int32_t slabs, BlockCounts swap = {}) {
  CacheConfig c;
  c.shape = CacheShape{2, 1, 16, 16};
  c.slab_bytes = 4096;
  c.arena_bytes = 4096 * static_cast<std::size_t>(slabs);
  c.swap_blocks = swap;
  c.fp16_windows_first = true;
  return c;
}

// Window w scores 1 - 0.1 w; window 0 is FP16, the others `fill`.
inline PrecisionPlan plan_for(const TokenLayout& layout, Precision fill = Precision::FP16) {
  PrecisionPlan plan(2, layout.num_windows(16), fill);
  for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
    plan.set_score(w, 1.0f - 0.1f * static_cast<float>(w));
    for (std::int32_t l = 0; l < 2; ++l) plan.set(l, w, w == 0 ? Precision::FP16 : fill);
  }
  return plan;
}

inline Request request(RequestId id, std::vector<Segment> segments, std::int32_t max_new,
                       Precision fill = Precision::FP16) {
  Request r;
  r.id = id;
  r.layout = TokenLayout(std::move(segments));
  r.plan = plan_for(r.layout, fill);
  r.max_new_tokens = max_new;
  r.arrival_time = static_cast<double>(id);
  return r;
}

inline SchedulerConfig base_config() {
  SchedulerConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.watermark = 0.0;
  return c;
}

}  // namespace mixkv::test
