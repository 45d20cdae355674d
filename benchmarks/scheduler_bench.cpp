// Host time of one scheduler step in the steady decode state: N running
// sequences x 28 layers (Qwen2-7B shapes: 4 KV heads, head_dim 128, window
// 32), each with a 1,088-token prompt (32 text, 32 visual windows under a
// WindowQuant-like plan, 32 text) and decoding. A step decides the batch,
// appends one token per sequence in every layer (AppendResult: 28 x N slots)
// and, with build_metadata, writes the full CSR decode metadata of all 28
// layers x 3 pools. With per_layer_slots off the step hands out the
// compact slots only (offsets + the tails that changed): O(N) outside block
// boundaries. Targets: <= 20 us at 256 sequences, <= 80 us at 1,024.
//
//   scheduler_bench --benchmark_filter=Step
#include <benchmark/benchmark.h>

#include <memory>
#include <random>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv {
namespace {

constexpr std::int32_t kLayers = 28;

CacheConfig qwen2_cache() {
  CacheConfig c;
  c.shape = CacheShape{kLayers, 4, 128, 32};
  c.arena_bytes = std::size_t{256} << 30;  // bookkeeping only: room for a few thousand steps of growth
  c.fp16_windows_first = true;
  return c;
}

Request video_request(RequestId id, std::mt19937& rng) {
  Request r;
  r.id = id;
  // Questions of 32..63 tokens: sequences reach block boundaries on
  // different steps, as in a server (not all 1,024 on the same step).
  const std::int32_t question = 32 + static_cast<std::int32_t>(id % 32);
  r.layout = TokenLayout({{TokenKind::Text, 32}, {TokenKind::Visual, 1024}, {TokenKind::Text, question}});
  PrecisionPlan plan(kLayers, 32);
  std::uniform_int_distribution<int> dice(0, 9);
  for (std::int32_t w = 0; w < 32; ++w) {
    plan.set_score(w, static_cast<float>(dice(rng)) / 10.0f);
    for (std::int32_t l = 0; l < kLayers; ++l) {
      const int d = dice(rng);
      plan.set(l, w, w == 0 || d < 2 ? Precision::FP16 : (d < 7 ? Precision::INT4 : Precision::INT2));
    }
  }
  r.plan = std::move(plan);
  r.max_new_tokens = 1 << 20;  // never finishes while timed
  r.arrival_time = static_cast<double>(id);
  return r;
}

// N sequences admitted and prefilled; every later step is a pure decode step.
// The pools are warm, as in a server that has run a while: a filler
// sequence took (and gave back) the FP16 blocks the timed steps will need,
// so growth reuses free blocks instead of carving new slabs.
struct SteadyState {
  KVCacheManager cache;
  Scheduler sched;

  SteadyState(std::int32_t n, bool metadata, bool per_layer_slots = true)
      : cache(qwen2_cache()), sched(warm(cache, n), config(n, metadata, per_layer_slots)) {
    std::mt19937 rng(7);
    for (std::int32_t i = 0; i < n; ++i) sched.add_request(video_request(i, rng));
    (void)sched.step();  // admits and prefills everything in one step
  }

  static KVCacheManager& warm(KVCacheManager& cache, std::int32_t n) {
    const std::int32_t tokens = n * 80 * 32;  // per layer: ~12 FP16 prompt blocks + 63 for 2,000 steps, per sequence
    cache.add_sequence(-1, TokenLayout({{TokenKind::Text, tokens}}), PrecisionPlan(kLayers, 0));
    cache.free_sequence(-1);
    return cache;
  }

  static SchedulerConfig config(std::int32_t n, bool metadata, bool per_layer_slots) {
    SchedulerConfig c;
    c.per_layer_slots = per_layer_slots;
    c.max_num_seqs = n;
    c.max_num_batched_tokens = n * 1200;
    c.build_metadata = metadata;
    c.watermark = 0.0;
    return c;
  }
};

void BM_Step(benchmark::State& state) {
  const auto n = static_cast<std::int32_t>(state.range(0));
  const bool metadata = state.range(1) != 0;
  SteadyState s(n, metadata, state.range(2) != 0);
  std::int64_t blocks = 0;
  for (auto _ : state) {
    StepOutput out = s.sched.step();
    if (out.decodes.size() != static_cast<std::size_t>(n)) state.SkipWithError("not a full decode batch");
    for (const auto& layer : out.metadata.layers) {
      for (const auto& t : layer) blocks += static_cast<std::int64_t>(t.indices.size());
    }
    benchmark::DoNotOptimize(out);
  }
  state.counters["seqs"] = n;
  state.counters["layers"] = kLayers;
  state.counters["metadata_block_ids"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_Step)
    ->ArgNames({"seqs", "metadata", "slots"})
    ->Args({256, 0, 0})
    ->Args({256, 0, 1})
    ->Args({256, 1, 1})
    ->Args({1024, 0, 0})
    ->Args({1024, 0, 1})
    ->Args({1024, 1, 1})
    ->Iterations(2000)
    ->Unit(benchmark::kMicrosecond);

// The manager's append alone (what a step spends most of its time in).
void BM_AppendTokens(benchmark::State& state) {
  const auto n = static_cast<std::int32_t>(state.range(0));
  SteadyState s(n, false);
  std::vector<SequenceId> ids(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
  for (auto _ : state) benchmark::DoNotOptimize(s.cache.append_tokens(ids));
}
BENCHMARK(BM_AppendTokens)->Arg(256)->Arg(1024)->Iterations(2000)->Unit(benchmark::kMicrosecond);

// slots: 1 = AppendSlots::PerLayer, 0 = AppendSlots::Compact.
void BM_AppendTokensByHandle(benchmark::State& state) {
  const auto n = static_cast<std::int32_t>(state.range(0));
  const AppendSlots form = state.range(1) != 0 ? AppendSlots::PerLayer : AppendSlots::Compact;
  SteadyState s(n, false);
  std::vector<SequenceHandle> handles;
  for (std::int32_t i = 0; i < n; ++i) handles.push_back(s.cache.handle(i));
  for (auto _ : state) benchmark::DoNotOptimize(s.cache.append_tokens(std::span<const SequenceHandle>(handles), form));
}
BENCHMARK(BM_AppendTokensByHandle)
    ->ArgNames({"seqs", "slots"})
    ->ArgsProduct({{256, 1024}, {0, 1}})
    ->Iterations(2000)
    ->Unit(benchmark::kMicrosecond);

// The manager's decode_metadata (all layers, CSR) for the same batch.
void BM_ManagerDecodeMetadata(benchmark::State& state) {
  const auto n = static_cast<std::int32_t>(state.range(0));
  SteadyState s(n, false);
  std::vector<SequenceId> ids(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
  for (auto _ : state) benchmark::DoNotOptimize(s.cache.decode_metadata(ids));
}
BENCHMARK(BM_ManagerDecodeMetadata)->Arg(256)->Arg(1024)->Iterations(200)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mixkv

BENCHMARK_MAIN();
