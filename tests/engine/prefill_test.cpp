// Engine::prefill: chunked prefill with attention through the cache. Each
// chunk's rows attend to what earlier chunks stored (quantized windows read
// quantized) and causally to each other; the engine keeps no prompt copy.
// Held to a float64 attention over the cache's own bytes, in an engine loop
// with forks, cancels, swaps, recomputes and demotions; the decode outputs
// equal those of store() bit for bit (prefill() stores the same bytes).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine_loop.h"
#include "mixkv/core/errors.h"
#include "mixkv/engine/cpu_backend.h"

namespace mixkv {
namespace {

using test::HostMemory;
using test::Outputs;
using test::RunStats;
using test::Workload;
using test::WorkloadOptions;

// 2 layers, 2 KV heads, 6 query heads (GQA 3), head_dim 64, block 32, chunks
// of at most 72 rows (not a multiple of 16): prompts span several chunks.
EngineConfig config(bool windows_first, std::int32_t slabs) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 32};
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = static_cast<std::size_t>(slabs) * c.cache.slab_bytes;
  c.cache.swap_blocks = {96, 96, 96};
  c.cache.fp16_windows_first = windows_first;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 72;
  c.scheduler.watermark = 0.0;
  c.scheduler.preemption = PreemptionMode::Swap;
  c.scheduler.demote_under_pressure = true;
  c.num_q_heads = 6;
  return c;
}

class PrefillLoop : public ::testing::TestWithParam<bool> {};

TEST_P(PrefillLoop, AttendsThroughTheCache) {
  for (const std::uint32_t seed : {1u, 2u}) {
    const EngineConfig c = config(GetParam(), seed == 1 ? 6 : 40);
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 15;
    o.max_new_tokens = 30;
    const Workload workload(c.cache.shape, o);
    Engine engine(c);
    HostMemory mem;
    Outputs got, want, stored;
    const RunStats stats = test::run_engine(engine, workload, mem, got, /*through_cache=*/true);
    test::run_reference(c, workload, want, /*prefill_outputs=*/true);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    // The decode outputs: the same bytes in the cache as store() leaves.
    const test::Diff decode = test::compare(got, want);
    EXPECT_EQ(decode.out, 0.0) << "seed " << seed;
    EXPECT_EQ(decode.lse, 0.0) << "seed " << seed;
    // The prefill rows against float64: one FP16 rounding of out apart.
    ASSERT_GT(got.prefill.size(), 0u);
    const test::Diff prefill = test::compare(got.prefill, want.prefill);
    EXPECT_LE(prefill.out, 1e-3) << "seed " << seed;
    EXPECT_LE(prefill.lse, 1e-4) << "seed " << seed;
    EXPECT_GT(stats.prefill_rows, 0);
    std::printf("seed %u: %zu prefill rows x layers, max |out| diff %.2e, |lse| diff %.2e\n", seed, got.prefill.size(),
                prefill.out, prefill.lse);
  }
}

INSTANTIATE_TEST_SUITE_P(Packing, PrefillLoop, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WindowsFirst" : "PromptOrder"; });

// Speculative decoding: each decode verifies up to 3 drafts in one attend()
// and a pseudo-random number is accepted. Every row equals the plain
// decode of the same position (one FP16 rounding apart: extend and decode
// arithmetic differ), in both packings, with and without memory pressure.
TEST_P(PrefillLoop, DraftRowsEqualPlainDecodes) {
  for (const std::uint32_t seed : {3u, 4u}) {
    EngineConfig c = config(GetParam(), seed == 3 ? 8 : 40);
    // Demotion picks windows by the schedule, which drafts change: without
    // it a position holds the same bytes in both runs (swaps and
    // recomputes store them again exactly).
    c.scheduler.demote_under_pressure = false;
    WorkloadOptions o;
    o.seed = seed;
    o.requests = 12;
    o.max_new_tokens = 30;
    o.forks = false;  // fork points and cancels depend on the schedule, which drafts change
    o.cancels = false;
    const Workload workload(c.cache.shape, o);
    HostMemory mem;
    Outputs plain, drafted;
    {
      Engine engine(c);
      test::run_engine(engine, workload, mem, plain, /*through_cache=*/true);
    }
    c.scheduler.num_speculative_tokens = 3;
    Engine engine(c);
    const RunStats stats = test::run_engine(engine, workload, mem, drafted, /*through_cache=*/true);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    EXPECT_GT(stats.drafts, 0);
    EXPECT_GT(stats.accepted, 0);
    EXPECT_LT(stats.accepted, stats.drafts);
    const test::Diff d = test::compare(drafted.rows, plain.rows, /*a_may_lack=*/true);
    EXPECT_LE(d.out, 1e-3) << "seed " << seed;
    EXPECT_LE(d.lse, 1e-4) << "seed " << seed;
    std::printf("seed %u: %lld drafts, %lld accepted, %zu decode rows, max |out| diff %.2e, |lse| diff %.2e\n", seed,
                static_cast<long long>(stats.drafts), static_cast<long long>(stats.accepted), drafted.rows.size(),
                d.out, d.lse);
  }
}

// Rows recorded by Engine::prefill against a float64 causal attention over
// the model's own K/V (every earlier row FP16, as the model made it, read
// from no cache): the largest |out| and |lse| difference.
test::Diff against_dense(const Outputs::Rows& rows, const CacheShape& s, std::int32_t q_heads) {
  const std::map<RequestId, std::pair<RequestId, std::int64_t>> no_forks;
  const auto d = static_cast<std::size_t>(s.head_dim);
  const auto kvh = static_cast<std::size_t>(s.num_kv_heads);
  const auto group = static_cast<std::size_t>(q_heads) / kvh;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::map<std::pair<RequestId, std::int32_t>, std::pair<std::vector<Half>, std::vector<Half>>> kv;  // rows 0..
  test::Diff diff;
  for (const auto& [key, got] : rows) {
    const auto [id, pos, layer] = key;
    auto& [k, v] = kv[{id, layer}];
    const auto have = static_cast<std::int64_t>(k.size() / (kvh * d));
    if (have <= pos) {
      test::model_rows(no_forks, id, have, pos + 1, layer, s.num_kv_heads, s.head_dim, 1, k);
      test::model_rows(no_forks, id, have, pos + 1, layer, s.num_kv_heads, s.head_dim, 2, v);
    }
    std::vector<Half> q;
    test::model_rows(no_forks, id, pos, pos + 1, layer, q_heads, s.head_dim, 7, q);
    for (std::size_t h = 0; h < static_cast<std::size_t>(q_heads); ++h) {
      const std::size_t g = h / group;
      std::vector<double> score(static_cast<std::size_t>(pos) + 1);
      for (std::size_t t = 0; t < score.size(); ++t) {
        double dot = 0.0;
        for (std::size_t c = 0; c < d; ++c) {
          dot += double{half_to_float(q[h * d + c])} * half_to_float(k[(t * kvh + g) * d + c]);
        }
        score[t] = dot * scale;
      }
      const double m = *std::max_element(score.begin(), score.end());
      double sum = 0.0;
      std::vector<double> acc(d, 0.0);
      for (std::size_t t = 0; t < score.size(); ++t) {
        const double w = std::exp(score[t] - m);
        sum += w;
        for (std::size_t c = 0; c < d; ++c) acc[c] += w * half_to_float(v[(t * kvh + g) * d + c]);
      }
      for (std::size_t c = 0; c < d; ++c) {
        const float want = half_to_float(float_to_half(static_cast<float>(acc[c] / sum)));
        diff.out = std::max(diff.out, static_cast<double>(std::abs(got.first[h * d + c] - want)));
      }
      diff.lse = std::max(diff.lse, std::abs(static_cast<double>(got.second[h]) - (m + std::log(sum))));
    }
  }
  return diff;
}

// PrefillMode::Exact: a prompt prefilled in chunks is held FP16 until its
// last chunk, so every prefill row equals a dense FP16 causal attention
// over the model's own K/V (one FP16 rounding of out apart), where compact
// mode's later chunks read quantized windows. After the plan's demotions
// (the step after the last chunk) the decodes read the quantized windows:
// with no memory pressure both modes run the same schedule and every decode
// output is equal bit for bit (the demote kernel quantizes an FP16 window
// as the store does). Under pressure (swaps, recomputes, demotions) the
// engine still equals the hand-applied reference and the dense attention.
TEST(EnginePrefill, ExactModeEqualsDenseFp16AndDecodesLikeCompact) {
  WorkloadOptions o;
  o.seed = 5;
  o.requests = 12;
  o.max_new_tokens = 12;
  o.forks = false;  // fork points and cancels depend on the schedule, which memory changes
  o.cancels = false;
  EngineConfig c = config(true, 200);
  const Workload workload(c.cache.shape, o);
  HostMemory mem;
  Outputs compact, exact;
  {
    Engine engine(c);
    test::run_engine(engine, workload, mem, compact, /*through_cache=*/true);
    test::expect_empty(engine.cache());
  }
  c.scheduler.prefill_mode = PrefillMode::Exact;
  Engine engine(c);
  test::run_engine(engine, workload, mem, exact, /*through_cache=*/true);
  EXPECT_FALSE(engine.has_unfinished());
  test::expect_empty(engine.cache());
  const SchedulerStats st = engine.scheduler().stats();
  EXPECT_GT(st.plan_demotions, 0);
  EXPECT_EQ(st.demotions + st.preempted_swap + st.preempted_recompute, 0);
  const test::Diff exact_dense = against_dense(exact.prefill, c.cache.shape, c.num_q_heads);
  const test::Diff compact_dense = against_dense(compact.prefill, c.cache.shape, c.num_q_heads);
  EXPECT_LE(exact_dense.out, 1e-3);
  EXPECT_LE(exact_dense.lse, 1e-4);
  EXPECT_GT(compact_dense.out, 1e-2) << "compact mode's later chunks read no quantized window";
  const test::Diff decode = test::compare(exact.rows, compact.rows);
  EXPECT_EQ(decode.out, 0.0);
  EXPECT_EQ(decode.lse, 0.0);
  std::printf(
      "%lld plan demotions; prefill rows vs dense FP16: exact %.2e (lse %.2e), compact %.2e (lse %.2e); decodes "
      "exact vs compact %.2e\n",
      static_cast<long long>(st.plan_demotions), exact_dense.out, exact_dense.lse, compact_dense.out, compact_dense.lse,
      decode.out);
}

TEST(EnginePrefill, ExactModeUnderPressureMatchesTheReference) {
  for (const PreemptionMode mode : {PreemptionMode::Swap, PreemptionMode::Recompute}) {
    EngineConfig c = config(true, 8);
    c.scheduler.prefill_mode = PrefillMode::Exact;
    c.scheduler.preemption = mode;
    WorkloadOptions o;
    o.seed = 1;
    o.requests = 24;
    o.max_new_tokens = 30;
    o.forks = false;  // the dense reference takes no lineage
    const Workload workload(c.cache.shape, o);
    Engine engine(c);
    HostMemory mem;
    Outputs got, want;
    const RunStats stats = test::run_engine(engine, workload, mem, got, /*through_cache=*/true);
    test::run_reference(c, workload, want, /*prefill_outputs=*/true);
    EXPECT_FALSE(engine.has_unfinished());
    test::expect_empty(engine.cache());
    const SchedulerStats st = engine.scheduler().stats();
    EXPECT_GT(st.plan_demotions, 0);
    EXPECT_GT(st.plan_waits, 0);
    EXPECT_GT(st.demotions, 0);
    EXPECT_GT(mode == PreemptionMode::Swap ? stats.swaps_out : stats.recomputes, 0);
    const test::Diff decode = test::compare(got, want);
    EXPECT_EQ(decode.out, 0.0);
    EXPECT_EQ(decode.lse, 0.0);
    const test::Diff reference = test::compare(got.prefill, want.prefill);
    EXPECT_LE(reference.out, 1e-3);
    const test::Diff dense = against_dense(got.prefill, c.cache.shape, c.num_q_heads);
    EXPECT_LE(dense.out, 1e-3);
    EXPECT_LE(dense.lse, 1e-4);
    std::printf(
        "%lld plan demotions (%lld waits), %lld pressure demotions, %lld swaps, %lld recomputes; prefill rows vs "
        "dense FP16 %.2e (lse %.2e)\n",
        static_cast<long long>(st.plan_demotions), static_cast<long long>(st.plan_waits),
        static_cast<long long>(st.demotions), static_cast<long long>(stats.swaps_out),
        static_cast<long long>(stats.recomputes), dense.out, dense.lse);
  }
}

// --- Prefix caching (CacheConfig::prefix_cache) ---
// The model stand-in of these tests: a prompt row's K/V is a function of the
// prompt's content up to it (its keys and kinds: what a causal model's are),
// so two prompts with a common prefix have the same K/V there; queries and
// generated tokens' K/V are the request's own.
struct PrefixRequest {
  Request request;
  std::int64_t arrives = 0;  // loop step
};

struct PrefixRun {
  Outputs outputs;
  test::Diff prefill_vs_dense;                    // prefill rows against float64 over the cache's bytes
  std::map<RequestId, std::int32_t> first_start;  // first chunk's start row per request
  std::map<RequestId, PrecisionPlan> plans;       // as stored at admission
  SchedulerStats stats;
};

// [row]: the content id of each prompt row (a hash of the rows up to it).
std::vector<std::uint64_t> content_ids(const Request& r) {
  std::vector<std::uint64_t> ids;
  std::uint64_t h = 0x9e37;
  std::size_t row = 0;
  for (const Segment& seg : r.layout.segments()) {
    for (std::int32_t i = 0; i < seg.length; ++i, ++row) {
      h = mix64(h ^ mix64(r.token_keys.at(row) + (seg.kind == TokenKind::Visual ? 1 : 0)));
      ids.push_back(h);
    }
  }
  return ids;
}

PrefixRun run_prefix(const EngineConfig& c, const std::vector<PrefixRequest>& requests) {
  PrefixRun run;
  Engine engine(c);
  auto* cpu = dynamic_cast<CpuBackend*>(&engine.backend());
  const CacheShape& s = c.cache.shape;
  const std::int32_t qh = c.num_q_heads;
  std::map<RequestId, std::vector<std::uint64_t>> content;
  std::map<RequestId, std::int32_t> prompt;
  // Rows [from, to) of `id`: K/V (what 1, 2) by content below the prompt's
  // end, by request after; queries (what 7) by request.
  auto rows = [&](RequestId id, std::int64_t from, std::int64_t to, std::int32_t layer, std::int32_t heads,
                  std::int32_t what, std::vector<Half>& out) {
    for (std::int64_t pos = from; pos < to; ++pos) {
      const bool by_content = what != 7 && pos < prompt.at(id);
      const auto who = static_cast<RequestId>(by_content ? content.at(id)[static_cast<std::size_t>(pos)] >> 2 : id);
      for (std::int32_t h = 0; h < heads; ++h) {
        for (std::int32_t ch = 0; ch < s.head_dim; ++ch) out.push_back(test::model_value(who, pos, layer, h, ch, what));
      }
    }
  };
  HostMemory mem;
  for (std::int64_t step = 0; step < 400; ++step) {
    for (const PrefixRequest& r : requests) {
      if (r.arrives != step) continue;
      engine.add_request(r.request);
      content[r.request.id] = content_ids(r.request);
      prompt[r.request.id] = r.request.layout.num_tokens();
    }
    if (!engine.has_unfinished()) break;
    const StepOutput& out = engine.step();
    std::int64_t n = 0;
    for (const PrefillChunk& chunk : out.prefills) {
      n += chunk.end - chunk.start;
      if (run.first_start.emplace(chunk.id, chunk.start).second)
        run.plans.emplace(chunk.id, engine.cache().plan(chunk.id));
    }
    const auto batch = static_cast<std::int64_t>(out.decodes.size());
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      if (n > 0) {
        std::vector<Half> q, k, v;
        for (const PrefillChunk& chunk : out.prefills) {
          std::vector<Half> cq, ck, cv;
          rows(chunk.id, chunk.start, chunk.end, layer, qh, 7, cq);
          rows(chunk.id, chunk.start, chunk.end, layer, s.num_kv_heads, 1, ck);
          rows(chunk.id, chunk.start, chunk.end, layer, s.num_kv_heads, 2, cv);
          std::vector<float> o, l;
          test::dense_prefill(engine.cache(), cpu->arena_pools(), chunk.id, chunk.start, layer, qh, cq, ck, cv, o, l);
          test::record(
              run.outputs.prefill, static_cast<std::size_t>(chunk.end - chunk.start),
              [&](std::size_t) { return chunk.id; }, [&](std::size_t i) { return chunk.start + std::int64_t(i); },
              layer, o, l, qh);
          q.insert(q.end(), cq.begin(), cq.end());
          k.insert(k.end(), ck.begin(), ck.end());
          v.insert(v.end(), cv.begin(), cv.end());
        }
        const TensorView o = mem.output(DType::F16, {n, qh, s.head_dim});
        const TensorView lse = mem.output(DType::F32, {n, qh});
        engine.prefill(layer, mem.input(q, {n, qh, s.head_dim}), mem.input(k, {n, s.num_kv_heads, s.head_dim}),
                       mem.input(v, {n, s.num_kv_heads, s.head_dim}), o, &lse);
        Outputs::Rows got;
        std::size_t at = 0;
        const std::vector<float> of = mem.read(o), lf = mem.read(lse);
        for (const PrefillChunk& chunk : out.prefills) {
          const std::size_t m = static_cast<std::size_t>(chunk.end - chunk.start);
          const std::size_t width = static_cast<std::size_t>(qh * s.head_dim);
          test::record(
              got, m, [&](std::size_t) { return chunk.id; },
              [&](std::size_t i) { return chunk.start + std::int64_t(i); }, layer,
              std::vector<float>(of.begin() + static_cast<std::ptrdiff_t>(at * width),
                                 of.begin() + static_cast<std::ptrdiff_t>((at + m) * width)),
              std::vector<float>(lf.begin() + static_cast<std::ptrdiff_t>(at * qh),
                                 lf.begin() + static_cast<std::ptrdiff_t>((at + m) * qh)),
              qh);
          at += m;
        }
        Outputs::Rows want;
        for (const auto& [key, value] : got) want[key] = run.outputs.prefill.at(key);
        const test::Diff d = test::compare(got, want);
        run.prefill_vs_dense.out = std::max(run.prefill_vs_dense.out, d.out);
        run.prefill_vs_dense.lse = std::max(run.prefill_vs_dense.lse, d.lse);
      }
      if (batch == 0) continue;
      std::vector<Half> q, k, v;
      for (const RequestId id : out.decodes) {
        const std::int64_t pos = engine.cache().num_tokens(id) - 1;
        rows(id, pos, pos + 1, layer, qh, 7, q);
        rows(id, pos, pos + 1, layer, s.num_kv_heads, 1, k);
        rows(id, pos, pos + 1, layer, s.num_kv_heads, 2, v);
      }
      const TensorView o = mem.output(DType::F16, {batch, qh, s.head_dim});
      const TensorView lse = mem.output(DType::F32, {batch, qh});
      engine.attend(layer, mem.input(q, {batch, qh, s.head_dim}), mem.input(k, {batch, s.num_kv_heads, s.head_dim}),
                    mem.input(v, {batch, s.num_kv_heads, s.head_dim}), o, &lse);
      test::record(
          run.outputs.rows, out.decodes.size(), [&](std::size_t i) { return out.decodes[i]; },
          [&](std::size_t i) { return engine.cache().num_tokens(out.decodes[i]) - 1; }, layer, mem.read(o),
          mem.read(lse), qh);
    }
    mem.release();
    engine.scheduler().check_invariants();
  }
  EXPECT_FALSE(engine.has_unfinished());
  run.stats = engine.scheduler().stats();
  // What is left is the index's alone: evicting it empties the cache.
  const PrefixCacheStats cached = engine.cache().prefix_stats();
  EXPECT_EQ(cached.cached, cached.evictable);
  const_cast<KVCacheManager&>(engine.cache()).evict_prefix_cache();
  test::expect_empty(engine.cache());
  return run;
}

// 2 layers, 2 KV heads, head_dim 64, block 16, chunks of at most 64 rows,
// memory to spare (no demotion, no preemption: the bytes of a position do
// not depend on the schedule).
EngineConfig prefix_config(bool windows_first, bool caching) {
  EngineConfig c;
  c.cache.shape = CacheShape{2, 2, 64, 16};
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = std::size_t{200} * c.cache.slab_bytes;
  c.cache.fp16_windows_first = windows_first;
  c.cache.prefix_cache.enabled = caching;
  c.scheduler.max_num_seqs = 8;
  c.scheduler.max_num_batched_tokens = 64;
  c.scheduler.watermark = 0.0;
  c.num_q_heads = 4;
  return c;
}

// A system text of 32 rows, a video of 4 windows (rows 32..96) planned
// FP16, INT4, INT2, INT4 (window 1 INT2 in layer 1), a question of
// `question_rows` from question `question`.
PrefixRequest video_question(RequestId id, std::int64_t arrives, std::int32_t question, std::int32_t question_rows) {
  PrefixRequest r{Request{}, arrives};
  r.request.id = id;
  r.request.layout = TokenLayout({{TokenKind::Text, 32}, {TokenKind::Visual, 64}, {TokenKind::Text, question_rows}});
  PrecisionPlan plan(2, 4);
  for (std::int32_t l = 0; l < 2; ++l) {
    plan.set(l, 1, l == 1 ? Precision::INT2 : Precision::INT4);
    plan.set(l, 2, Precision::INT2);
    plan.set(l, 3, Precision::INT4);
  }
  r.request.plan = plan;
  for (std::int32_t i = 0; i < 96; ++i) r.request.token_keys.push_back(1000 + i);
  for (std::int32_t i = 0; i < question_rows; ++i) r.request.token_keys.push_back(5000 + 100 * question + i);
  r.request.max_new_tokens = 6;
  r.request.arrival_time = static_cast<double>(id);
  return r;
}

class PrefixCacheLoop : public ::testing::TestWithParam<bool> {};

// The second request with a prompt the cache holds prefills only what
// follows the cached prefix, and decodes bit for bit as with prefix
// caching off: a text prompt asked again, and one video asked several
// questions (one of them twice).
TEST_P(PrefixCacheLoop, ASecondPromptPrefillsOnlyItsSuffix) {
  PrefixRequest text_a{Request{}, 0};
  text_a.request.id = 1;
  text_a.request.layout = TokenLayout({{TokenKind::Text, 70}});
  for (std::int32_t i = 0; i < 70; ++i) text_a.request.token_keys.push_back(77 + i);
  text_a.request.max_new_tokens = 5;
  PrefixRequest text_b = text_a;
  text_b.request.id = 2;
  text_b.arrives = 4;
  const std::vector<PrefixRequest> requests{text_a,
                                            text_b,
                                            video_question(10, 0, 0, 7),
                                            video_question(11, 5, 1, 11),
                                            video_question(12, 5, 2, 3),
                                            video_question(13, 8, 0, 7)};
  const PrefixRun off = run_prefix(prefix_config(GetParam(), false), requests);
  const PrefixRun on = run_prefix(prefix_config(GetParam(), true), requests);
  EXPECT_EQ(on.first_start.at(1), 0);
  EXPECT_EQ(on.first_start.at(2), 64);  // 4 full blocks; the last row is always computed
  EXPECT_EQ(on.first_start.at(10), 0);
  for (const RequestId id : {11, 12, 13}) EXPECT_EQ(on.first_start.at(id), 96) << id;  // text and video
  for (const auto& [id, start] : off.first_start) EXPECT_EQ(start, 0);
  EXPECT_EQ(on.stats.prefix_hits, 4);
  EXPECT_EQ(on.stats.cached_prompt_tokens, 64 + 3 * 96);
  EXPECT_EQ(on.stats.prefill_tokens, off.stats.prefill_tokens - on.stats.cached_prompt_tokens);
  // Shared per video hit: 2 layers x (2 text blocks + FP16 window 0 + 3 quantized windows).
  EXPECT_EQ(on.stats.shared_blocks, 2 * 4 + 3 * 2 * 6);
  EXPECT_GT(on.stats.published_blocks, 0);
  const test::Diff decode = test::compare(on.outputs, off.outputs);
  EXPECT_EQ(decode.out, 0.0);
  EXPECT_EQ(decode.lse, 0.0);
  // The suffix's rows attend through the shared blocks: what float64
  // attention over the cache's bytes gives, one FP16 rounding apart.
  EXPECT_LE(on.prefill_vs_dense.out, 1e-3);
  EXPECT_LE(on.prefill_vs_dense.lse, 1e-4);
  std::printf("prefill rows: %lld with prefix caching, %lld without; %lld blocks shared\n",
              static_cast<long long>(on.stats.prefill_tokens), static_cast<long long>(off.stats.prefill_tokens),
              static_cast<long long>(on.stats.shared_blocks));
}

// A question whose plan wants a window lower than the cache holds it takes
// the cached precision (share_higher) and decodes as a run without prefix
// caching given that plan; one that wants it higher recomputes from there.
TEST_P(PrefixCacheLoop, HigherPrecisionWindowsAreSharedAsStored) {
  PrefixRequest lower = video_question(21, 4, 1, 9);
  lower.request.plan->set(0, 3, Precision::INT2);  // cached INT4
  PrefixRequest higher = video_question(22, 4, 2, 9);
  higher.request.plan->set(1, 2, Precision::INT4);  // cached INT2
  std::vector<PrefixRequest> requests{video_question(20, 0, 0, 7), lower, higher};
  const PrefixRun on = run_prefix(prefix_config(GetParam(), true), requests);
  EXPECT_EQ(on.first_start.at(21), 96);
  EXPECT_EQ(on.plans.at(21).at(0, 3), Precision::INT4);
  EXPECT_EQ(on.first_start.at(22), 64);
  EXPECT_EQ(on.plans.at(22), *higher.request.plan);
  for (PrefixRequest& r : requests) r.request.plan = on.plans.at(r.request.id);
  const PrefixRun off = run_prefix(prefix_config(GetParam(), false), requests);
  const test::Diff decode = test::compare(on.outputs, off.outputs);
  EXPECT_EQ(decode.out, 0.0);
  EXPECT_EQ(decode.lse, 0.0);
}

// Prefix caching by content (PrefixIdentity::Content, PrefillMode::Exact):
// questions whose plans differ in every window prefill the video once, and
// each decodes bit for bit as with prefix caching off, at its own plan.
TEST(PrefixCacheContent, QuestionsWithTheirOwnPlansShareTheVideo) {
  auto config = [](bool caching) {
    EngineConfig c = prefix_config(true, caching);
    c.cache.prefix_cache.identity = PrefixIdentity::Content;
    c.scheduler.prefill_mode = PrefillMode::Exact;
    return c;
  };
  constexpr std::array<Precision, 3> kCycle{Precision::FP16, Precision::INT4, Precision::INT2};
  std::vector<PrefixRequest> requests{video_question(30, 0, 0, 7)};
  for (std::int32_t q = 1; q <= 4; ++q) {
    PrefixRequest r = video_question(30 + q, 4 + q, q, 5 + 2 * q);
    for (std::int32_t l = 0; l < 2; ++l) {
      for (std::int32_t w = 1; w < 4; ++w) r.request.plan->set(l, w, kCycle[static_cast<std::size_t>((q + w + l) % 3)]);
    }
    requests.push_back(r);
  }
  const PrefixRun on = run_prefix(config(true), requests);
  const PrefixRun off = run_prefix(config(false), requests);
  for (std::int32_t q = 1; q <= 4; ++q) EXPECT_EQ(on.first_start.at(30 + q), 96) << q;
  EXPECT_EQ(on.stats.prefix_hits, 4);
  EXPECT_EQ(on.stats.cached_prompt_tokens, 4 * 96);
  EXPECT_EQ(on.stats.prefill_tokens, off.stats.prefill_tokens - 4 * 96);
  const test::Diff decode = test::compare(on.outputs, off.outputs);
  EXPECT_EQ(decode.out, 0.0);
  EXPECT_EQ(decode.lse, 0.0);
  EXPECT_LE(on.prefill_vs_dense.out, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Packing, PrefixCacheLoop, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WindowsFirst" : "PromptOrder"; });

// Arrays of the wrong shape, overlapping outputs and a bad layer are named
// and leave the scheduler as it was.
TEST(EnginePrefill, BadArraysAreNamed) {
  EngineConfig c = config(true, 40);
  Engine engine(c);
  Request r;
  r.id = 1;
  r.layout = TokenLayout({{TokenKind::Text, 20}});
  r.max_new_tokens = 2;
  engine.add_request(r);
  const StepOutput& s = engine.step();
  ASSERT_EQ(s.prefills.size(), 1u);
  const std::int64_t rows = 20;
  std::vector<Half> q(static_cast<std::size_t>(rows * 6 * 64)), kv(static_cast<std::size_t>(rows * 2 * 64));
  std::vector<Half> out(q.size());
  const auto view = [](void* p, DType t, std::initializer_list<std::int64_t> shape) {
    return HostMemory::view(p, t, shape);
  };
  const std::string before = engine.scheduler().describe_state();
  auto expect_named = [&](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "expected an error naming " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_named(
      [&] {
        engine.prefill(0, view(q.data(), DType::F16, {rows - 1, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                       view(kv.data(), DType::F16, {rows, 2, 64}), view(out.data(), DType::F16, {rows, 6, 64}));
      },
      "q");
  expect_named(
      [&] {
        engine.prefill(0, view(q.data(), DType::F16, {rows, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                       view(kv.data(), DType::F16, {rows, 2, 64}), view(q.data(), DType::F16, {rows, 6, 64}));
      },
      "out overlaps q");
  EXPECT_THROW(engine.prefill(2, view(q.data(), DType::F16, {rows, 6, 64}), view(kv.data(), DType::F16, {rows, 2, 64}),
                              view(kv.data(), DType::F16, {rows, 2, 64}), view(out.data(), DType::F16, {rows, 6, 64})),
               IndexOutOfRange);
  EXPECT_EQ(engine.scheduler().describe_state(), before);
}

}  // namespace
}  // namespace mixkv
