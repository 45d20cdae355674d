// Decode attention on the CPU backend (cpu::decode_attention): one layer of
// one sequence, its K/V stored through KVCacheManager + cpu::store_prefill.
// Shapes: SmolLM2-135M (9 query / 3 KV heads, head_dim 64; the real-model
// check's model, docs/real-model.md) at 3,072 tokens, and Qwen2-7B (28 / 4,
// head_dim 128) at 4,096 tokens; block 32; all-FP16, all-INT4, all-INT2 and
// the mixed plan of the GPU benchmark (10% FP16, 30% INT4, 60% INT2 of the
// windows, spread evenly). The CPU backend is the double-precision
// reference, and the demo's decode loop on machines without a GPU.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "mixkv/cache/half.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/store.h"

namespace mixkv {
namespace {

struct Shape {
  std::int32_t q_heads, kv_heads, head_dim, tokens;
};
constexpr Shape kShapes[] = {{9, 3, 64, 3072}, {28, 4, 128, 4096}};
constexpr std::int32_t kBlock = 32;
constexpr const char* kPlanNames[] = {"fp16", "int4", "int2", "mixed"};

// Window w of the mixed plan: per 10 windows, 1 FP16, 3 INT4, 6 INT2.
Precision mixed_precision(std::int32_t w) {
  const std::int32_t r = w % 10;
  return r == 0 ? Precision::FP16 : (r <= 3 ? Precision::INT4 : Precision::INT2);
}

// One stored sequence and its decode inputs.
struct Problem {
  std::unique_ptr<KVCacheManager> manager;
  std::vector<std::byte> arena;
  DecodeMetadata metadata;
  cpu::PoolViews pools;
  std::vector<Half> q;
  std::vector<float> out, lse;

  Problem(const Shape& s, int plan_index) {
    const CacheShape shape{.num_layers = 1, .num_kv_heads = s.kv_heads, .head_dim = s.head_dim, .block_size = kBlock};
    const TokenLayout layout({{TokenKind::Visual, s.tokens}});
    const std::int32_t windows = layout.num_windows(kBlock);
    PrecisionPlan plan(1, windows, Precision::FP16);
    for (std::int32_t w = 0; w < windows; ++w) {
      const Precision p = plan_index == 3 ? mixed_precision(w) : kAllPrecisions[plan_index];
      plan.set(0, w, p);
    }
    const std::size_t slab = std::size_t{1} << 20;
    const std::size_t bytes = (static_cast<std::size_t>(s.tokens) * s.kv_heads * s.head_dim * 4 / slab + 8) * slab;
    manager = std::make_unique<KVCacheManager>(CacheConfig{.shape = shape, .arena_bytes = bytes, .slab_bytes = slab});
    arena.resize(bytes);
    manager->add_sequence(0, layout, plan);
    for (Precision p : kAllPrecisions) pools[pool_index(p)] = manager->pool_view(p, arena.data());

    // K/V and q from a cheap deterministic generator in [-1, 1).
    std::uint32_t state = 12345;
    auto next = [&] {
      state = state * 1664525u + 1013904223u;
      return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
    };
    std::vector<Half> k(static_cast<std::size_t>(s.tokens) * s.kv_heads * s.head_dim);
    std::vector<Half> v(k.size());
    for (Half& x : k) x = float_to_half(next());
    for (Half& x : v) x = float_to_half(next());
    cpu::store_prefill(k, v, manager->prefill_mapping(0, 0), pools);
    q.resize(static_cast<std::size_t>(s.q_heads) * s.head_dim);
    for (Half& x : q) x = float_to_half(next());
    out.resize(q.size());
    lse.resize(static_cast<std::size_t>(s.q_heads));
    const SequenceId ids[] = {0};
    metadata = manager->decode_metadata(ids);
  }
};

void BM_DecodeAttention(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  Problem problem(s, static_cast<int>(state.range(1)));
  const cpu::DecodeAttentionArgs args{.q = problem.q,
                                      .num_q_heads = s.q_heads,
                                      .sm_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                                      .tables = &problem.metadata.layers[0],
                                      .pools = problem.pools,
                                      .out = problem.out,
                                      .lse = problem.lse};
  for (auto _ : state) {
    cpu::decode_attention(args);
    benchmark::DoNotOptimize(problem.out.data());
  }
  state.SetLabel(std::string(s.head_dim == 64 ? "SmolLM2 9/3x64" : "Qwen2 28/4x128") + " " +
                 kPlanNames[state.range(1)]);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(s.tokens) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"shape", "plan"})
    ->ArgsProduct({{0, 1}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace mixkv

BENCHMARK_MAIN();
