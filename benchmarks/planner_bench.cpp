// WindowQuant planner on the CPU at the paper's setting: 100 frames x 196
// visual tokens, 64 text tokens, hidden 3,584 and 28 layers (Qwen2-7B).
// The timed unit is what a scheduler pays per request before admission:
// eq. 8 similarity + eqs. 10-11 thresholds + the plan. The paper's cosine
// search took 48 ms (on an A800).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/planner/window_planner.h"

namespace mixkv {
namespace {

constexpr std::int32_t kFrames = 100;
constexpr std::int32_t kTokensPerFrame = 196;
constexpr std::int32_t kHidden = 3584;
constexpr std::int32_t kLayers = 28;

// 14 system-prompt tokens, the video, a 50-token question.
TokenLayout bench_layout() {
  return TokenLayout({{TokenKind::Text, 14}, {TokenKind::Visual, kFrames * kTokensPerFrame}, {TokenKind::Text, 50}});
}

PlannerConfig bench_config() {
  PlannerConfig config;
  config.window_size = 32;
  for (std::int32_t l = 0; l < kLayers; ++l) config.sensitivities.push_back(0.3 + 0.6 * l / (kLayers - 1));
  return config;
}

// Embeddings in the three element types, from one cheap generator (filling
// 70M values with std::normal_distribution would dominate start-up).
struct BenchData {
  TokenLayout layout = bench_layout();
  std::vector<float> f32;
  std::vector<Half> f16;
  std::vector<std::uint16_t> bf16;

  BenchData() {
    const std::size_t n = static_cast<std::size_t>(layout.num_tokens()) * kHidden;
    f32.resize(n);
    f16.resize(n);
    bf16.resize(n);
    std::uint64_t state = 0x9e3779b97f4a7c15ull;
    for (std::size_t i = 0; i < n; ++i) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      // Uniform in [-1, 1) plus a shared offset per channel, so similarities are not ~0.
      const float noise = static_cast<float>(static_cast<std::int64_t>(state >> 40) - (1 << 23)) / (1 << 23);
      f32[i] = noise + 0.05f * static_cast<float>(i % kHidden % 7);
      f16[i] = float_to_half(f32[i]);
      std::uint32_t bits;
      std::memcpy(&bits, &f32[i], sizeof bits);
      bf16[i] = static_cast<std::uint16_t>(bits >> 16);
    }
  }

  EmbeddingsView view(ElementType type) const {
    const void* data = type == ElementType::F32   ? static_cast<const void*>(f32.data())
                       : type == ElementType::F16 ? static_cast<const void*>(f16.data())
                                                  : static_cast<const void*>(bf16.data());
    return {data, type, layout.num_tokens(), kHidden};
  }
};

const BenchData& data() {
  static const BenchData d;
  return d;
}

// Similarity + thresholds + plan: the planner is built inside the loop, so
// its eqs. 10-11 are paid every time.
void BM_PlanRequest(benchmark::State& state) {
  const auto type = static_cast<ElementType>(state.range(0));
  const EmbeddingsView view = data().view(type);
  for (auto _ : state) {
    const WindowPlanner planner(bench_config());
    PrecisionPlan plan = planner.plan(data().layout, view);
    benchmark::DoNotOptimize(plan);
  }
  const double bytes = static_cast<double>(data().layout.num_tokens()) * kHidden * (type == ElementType::F32 ? 4 : 2);
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PlanRequest)
    ->ArgName("type")  // 0 F32, 1 F16, 2 BF16
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The parts: eq. 8 alone, then thresholds + rule from given scores.
void BM_Similarity(benchmark::State& state) {
  const EmbeddingsView view = data().view(static_cast<ElementType>(state.range(0)));
  for (auto _ : state) {
    std::vector<float> scores = window_similarity(data().layout, view, 32);
    benchmark::DoNotOptimize(scores);
  }
}
BENCHMARK(BM_Similarity)->ArgName("type")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_ThresholdsAndPlan(benchmark::State& state) {
  const std::vector<float> scores = window_similarity(data().layout, data().view(ElementType::F16), 32);
  for (auto _ : state) {
    const WindowPlanner planner(bench_config());
    PrecisionPlan plan = planner.plan_from_scores(scores);
    benchmark::DoNotOptimize(plan);
  }
}
BENCHMARK(BM_ThresholdsAndPlan)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
}  // namespace mixkv

BENCHMARK_MAIN();
