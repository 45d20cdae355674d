#pragma once
// Batch invariance of an Engine's decode: one target request run alone and
// among other requests (added before it, after it, in other orders, some
// arriving while it decodes), its decode outputs recorded by (position,
// layer) and compared bitwise. The model stand-in of engine_loop.h gives
// every row's K, V and q as a pure function of (request, position, layer,
// head, channel), so the target's inputs are the same in every run; only
// the batch around it differs.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "engine_loop.h"

namespace mixkv::test {

// The target's decode outputs: (position, layer) -> (out, lse).
using TargetRows = std::map<std::pair<std::int64_t, std::int32_t>, std::pair<std::vector<float>, std::vector<float>>>;

// A cache and scheduler roomy enough that nothing is demoted, swapped or
// preempted, and every prompt of a step fits its token budget: the target's
// blocks and precisions are then the same in every run.
inline EngineConfig invariance_config(BackendKind kind, std::int32_t invariant_blocks) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};  // a built decode instance (head_dim 64, block 32)
  c.cache.slab_bytes = 1 << 20;
  c.cache.arena_bytes = 48 * c.cache.slab_bytes;
  c.cache.fp16_windows_first = true;
  c.scheduler.max_num_seqs = 16;
  c.scheduler.max_num_batched_tokens = 16384;
  c.scheduler.watermark = 0.0;
  c.scheduler.demote_under_pressure = false;
  c.scheduler.build_metadata = false;
  c.scheduler.per_layer_slots = false;
  c.num_q_heads = 4;
  c.backend = kind;
  c.batch_invariant_blocks = invariant_blocks;
  return c;
}

// Text, then `windows` visual windows of FP16, INT4 and INT2 by turns (the
// first FP16), then a partial window and text: the target spans all three
// pools in both layers.
inline Request invariance_request(RequestId id, std::int32_t windows, std::int32_t max_new_tokens, std::int32_t shift) {
  const std::int32_t block = 32;
  Request r;
  r.id = id;
  r.layout = TokenLayout({{TokenKind::Text, 9 + shift % 7},
                          {TokenKind::Visual, windows * block + 5 + shift % 11},
                          {TokenKind::Text, 6 + shift % 5}});
  PrecisionPlan plan(2, r.layout.num_windows(block));
  for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
    plan.set_score(w, static_cast<float>((w * 37 + shift) % 100) / 100.0f);
    for (std::int32_t l = 0; l < 2; ++l) {
      plan.set(l, w, w == 0 ? Precision::FP16 : static_cast<Precision>((w + l + shift) % 3));
    }
  }
  r.plan = plan;
  r.max_new_tokens = max_new_tokens;
  return r;
}

inline constexpr RequestId kTargetId = 7;
inline Request invariance_target() { return invariance_request(kTargetId, 24, 24, 0); }

// Eleven other requests: 1 to 27 windows, 3 to 40 new tokens.
inline std::vector<Request> invariance_others() {
  std::vector<Request> r;
  for (std::int32_t i = 0; i < 11; ++i) {
    r.push_back(invariance_request(100 + i, 1 + (i * 5) % 27, 3 + (i * 7) % 38, i + 1));
  }
  return r;
}

// Runs `arrivals` ((step, request), added in this order) to the end through
// store() and attend(), and returns the target's decode rows.
inline TargetRows run_for_target(Engine& engine, const std::vector<std::pair<std::int64_t, Request>>& arrivals,
                                 Memory& mem) {
  TargetRows rows;
  const std::map<RequestId, std::pair<RequestId, std::int64_t>> lineage;  // no forks
  const CacheShape& s = engine.config().cache.shape;
  const std::int32_t qh = engine.config().num_q_heads;
  const std::int64_t last_arrival = arrivals.empty() ? 0 : arrivals.back().first;
  for (std::int64_t step = 0; step < 1000; ++step) {
    for (const auto& [at, r] : arrivals) {
      if (at == step) engine.add_request(r);
    }
    if (!engine.has_unfinished() && step >= last_arrival) break;
    if (!engine.has_unfinished()) continue;
    const StepOutput& out = engine.step();
    EXPECT_TRUE(out.demotions.empty() && out.swap_out.empty() && out.preempted.empty())
        << "step " << step << ": the invariance config must not move or drop blocks";
    std::int64_t prefill_rows = 0;
    for (const PrefillChunk& c : out.prefills) prefill_rows += c.end - c.start;
    const auto batch = static_cast<std::int64_t>(out.decodes.size());
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      std::vector<Half> k, v;
      for (const PrefillChunk& c : out.prefills) {
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 1, k);
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 2, v);
      }
      engine.store(layer, mem.input(k, {prefill_rows, s.num_kv_heads, s.head_dim}),
                   mem.input(v, {prefill_rows, s.num_kv_heads, s.head_dim}));
      if (batch == 0) continue;
      std::vector<Half> q, dk, dv;
      std::vector<std::int64_t> positions;
      for (const RequestId id : out.decodes) {
        const std::int64_t p = engine.cache().num_tokens(id) - 1;
        positions.push_back(p);
        model_rows(lineage, id, p, p + 1, layer, qh, s.head_dim, 7, q);
        model_rows(lineage, id, p, p + 1, layer, s.num_kv_heads, s.head_dim, 1, dk);
        model_rows(lineage, id, p, p + 1, layer, s.num_kv_heads, s.head_dim, 2, dv);
      }
      const TensorView o = mem.output(DType::F16, {batch, qh, s.head_dim});
      const TensorView lse = mem.output(DType::F32, {batch, qh});
      engine.attend(layer, mem.input(q, {batch, qh, s.head_dim}), mem.input(dk, {batch, s.num_kv_heads, s.head_dim}),
                    mem.input(dv, {batch, s.num_kv_heads, s.head_dim}), o, &lse);
      const std::vector<float> outs = mem.read(o), lses = mem.read(lse);
      const std::size_t row = static_cast<std::size_t>(qh) * s.head_dim;
      for (std::size_t b = 0; b < out.decodes.size(); ++b) {
        if (out.decodes[b] != kTargetId) continue;
        rows[{positions[b], layer}] = {std::vector<float>(outs.begin() + static_cast<std::ptrdiff_t>(b * row),
                                                          outs.begin() + static_cast<std::ptrdiff_t>((b + 1) * row)),
                                       std::vector<float>(lses.begin() + static_cast<std::ptrdiff_t>(b * qh),
                                                          lses.begin() + static_cast<std::ptrdiff_t>((b + 1) * qh))};
      }
    }
    mem.release();
    engine.scheduler().check_invariants();
  }
  EXPECT_FALSE(engine.has_unfinished());
  return rows;
}

// The runs the tests compare, each a list of arrivals: alone; after every
// other request; first, the others in reverse; among them, the others split
// between step 0 and steps 2, 5 and 9 (prefilled while the target decodes).
inline std::vector<std::pair<const char*, std::vector<std::pair<std::int64_t, Request>>>> invariance_runs() {
  const Request target = invariance_target();
  const std::vector<Request> others = invariance_others();
  std::vector<std::pair<const char*, std::vector<std::pair<std::int64_t, Request>>>> runs;
  runs.push_back({"alone", {{0, target}}});
  auto& last = runs.emplace_back("last of 12", std::vector<std::pair<std::int64_t, Request>>{}).second;
  for (const Request& r : others) last.emplace_back(0, r);
  last.emplace_back(0, target);
  auto& first = runs.emplace_back("first, others reversed", std::vector<std::pair<std::int64_t, Request>>{}).second;
  first.emplace_back(0, target);
  for (auto it = others.rbegin(); it != others.rend(); ++it) first.emplace_back(0, *it);
  auto& staggered =
      runs.emplace_back("among others arriving while it decodes", std::vector<std::pair<std::int64_t, Request>>{})
          .second;
  for (std::size_t i = 0; i < others.size(); ++i) {
    if (i == 4) staggered.emplace_back(0, target);
    const std::int64_t at = i % 2 == 0 ? 0 : std::int64_t{2} + static_cast<std::int64_t>(i % 3) * 3 + (i > 6 ? 1 : 0);
    staggered.emplace_back(at, others[i]);
  }
  std::stable_sort(staggered.begin(), staggered.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return runs;
}

// Bitwise: every (position, layer) of `want` in `got` with the same bits.
inline void expect_same_bits(const TargetRows& want, const TargetRows& got, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::int64_t differing = 0;
  for (const auto& [key, rows] : want) {
    const auto it = got.find(key);
    ASSERT_NE(it, got.end()) << what << ": no row at position " << key.first << ", layer " << key.second;
    const bool same =
        rows.first.size() == it->second.first.size() && rows.second.size() == it->second.second.size() &&
        std::memcmp(rows.first.data(), it->second.first.data(), rows.first.size() * sizeof(float)) == 0 &&
        std::memcmp(rows.second.data(), it->second.second.data(), rows.second.size() * sizeof(float)) == 0;
    if (!same && differing++ < 3) {
      ADD_FAILURE() << what << ": position " << key.first << ", layer " << key.second << " differs from alone";
    }
  }
  EXPECT_EQ(differing, 0) << what << ": rows differing from the target decoded alone";
}

}  // namespace mixkv::test
