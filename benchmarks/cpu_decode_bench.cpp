// Decode attention on the CPU backend (cpu::decode_attention): one layer,
// K/V stored through KVCacheManager + cpu::store_prefill. Shapes:
// SmolLM2-135M (9 query / 3 KV heads, head_dim 64; the real-model check's
// model, docs/real-model.md), one sequence of 3,072 tokens; Qwen2-7B (28 / 4,
// head_dim 128), one of 4,096; Llama-3-8B (32 / 8, head_dim 128), a batch of
// 8 x 2,048; block 32; all-FP16, all-INT4, all-INT2 and the mixed plan of the
// GPU benchmark (10% FP16, 30% INT4, 60% INT2 of the windows, spread
// evenly); 1 and 2 threads (DecodeAttentionArgs::num_threads). The CPU
// backend is the reference for the CUDA kernels, and the decode of engines
// without a GPU.
// Side by side in the same run: a dense float32 attention over contiguous
// K/V of the same tokens, one thread (what a NumPy decode loop does: q K^T,
// softmax, P V), and this machine's single-thread read bandwidth (a sum over
// 256 MiB). Each decode case reports the bytes it reads (its blocks' K/V
// codes and parameters) and the rate. Plot and table:
// benchmarks/plot_cpu_decode.py. Against NumPy itself:
// benchmarks/cpu_decode_vs_numpy.py.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/half.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/store.h"

namespace mixkv {
namespace {

struct Shape {
  const char* name;
  std::int32_t q_heads, kv_heads, head_dim, tokens, batch;
};
constexpr Shape kShapes[] = {{"SmolLM2 9/3x64 1x3072", 9, 3, 64, 3072, 1},
                             {"Qwen2 28/4x128 1x4096", 28, 4, 128, 4096, 1},
                             {"Llama-3-8B 32/8x128 8x2048", 32, 8, 128, 2048, 8}};
constexpr std::int32_t kBlock = 32;
constexpr const char* kPlanNames[] = {"fp16", "int4", "int2", "mixed"};

// Window w of the mixed plan: per 10 windows, 1 FP16, 3 INT4, 6 INT2.
Precision mixed_precision(std::int32_t w) {
  const std::int32_t r = w % 10;
  return r == 0 ? Precision::FP16 : (r <= 3 ? Precision::INT4 : Precision::INT2);
}

// `batch` stored sequences and their decode inputs.
struct Problem {
  std::unique_ptr<KVCacheManager> manager;
  std::vector<std::byte> arena;
  DecodeMetadata metadata;
  PoolViews pools;
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
    const std::size_t bytes =
        (static_cast<std::size_t>(s.tokens) * s.batch * s.kv_heads * s.head_dim * 4 / slab + 8 + s.batch) * slab;
    manager = std::make_unique<KVCacheManager>(CacheConfig{.shape = shape, .arena_bytes = bytes, .slab_bytes = slab});
    arena.resize(bytes);
    for (Precision p : kAllPrecisions) pools[pool_index(p)] = manager->pool_view(p, arena.data());

    // K/V and q from a cheap deterministic generator in [-1, 1).
    std::uint32_t state = 12345;
    auto next = [&] {
      state = state * 1664525u + 1013904223u;
      return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
    };
    std::vector<SequenceId> ids;
    for (std::int32_t b = 0; b < s.batch; ++b) {
      manager->add_sequence(b, layout, plan);
      std::vector<Half> k(static_cast<std::size_t>(s.tokens) * s.kv_heads * s.head_dim);
      std::vector<Half> v(k.size());
      for (Half& x : k) x = float_to_half(next());
      for (Half& x : v) x = float_to_half(next());
      cpu::store_prefill(k, v, manager->prefill_mapping(b, 0), pools);
      ids.push_back(b);
    }
    q.resize(static_cast<std::size_t>(s.batch) * s.q_heads * s.head_dim);
    for (Half& x : q) x = float_to_half(next());
    out.resize(q.size());
    lse.resize(static_cast<std::size_t>(s.batch) * s.q_heads);
    metadata = manager->decode_metadata(ids);
    for (Precision p : kAllPrecisions) {
      const PagedPoolTable& table = metadata.layers[0][pool_index(p)];
      bytes_read +=
          static_cast<double>(table.indices.size()) * s.kv_heads * BlockFormat{p, 1, s.head_dim, kBlock}.head_bytes();
    }
  }

  double bytes_read = 0.0;  // K/V codes and parameters of the blocks, all KV heads
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
                                      .lse = problem.lse,
                                      .num_threads = static_cast<std::int32_t>(state.range(2))};
  for (auto _ : state) {
    cpu::decode_attention(args);
    benchmark::DoNotOptimize(problem.out.data());
  }
  state.SetLabel(std::string(s.name) + "|" + kPlanNames[state.range(1)] + "|" + std::to_string(state.range(2)));
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(s.tokens) * s.batch * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes/s"] = benchmark::Counter(problem.bytes_read * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = problem.bytes_read;
}

// Dense float32 decode attention of every query head over contiguous
// [token][kv_head][dim] K and V (the same shape, random values), one thread,
// the batch's sequences one after another.
void BM_DenseFp32(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  const std::size_t dim = static_cast<std::size_t>(s.head_dim);
  const std::size_t row = static_cast<std::size_t>(s.kv_heads) * dim;
  const std::size_t seq_values = static_cast<std::size_t>(s.tokens) * row;
  std::vector<float> k(seq_values * s.batch), v(k.size()), q(s.q_heads * dim), out(q.size());
  std::uint32_t seed = 777;
  for (std::vector<float>* x : {&k, &v, &q}) {
    for (float& f : *x) {
      seed = seed * 1664525u + 1013904223u;
      f = static_cast<float>(seed >> 8) / 8388608.0f - 1.0f;
    }
  }
  // A GQA group's heads share each K and V row read (as q K^T for the group
  // as one matrix product would); eight partial sums per dot product, so the
  // compiler vectorizes them as a BLAS dot would be.
  const int group = s.q_heads / s.kv_heads;
  std::vector<float> p(static_cast<std::size_t>(group) * s.tokens);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  for (auto _ : state) {
    for (int b = 0; b < s.batch; ++b) {
      const float* kb = &k[b * seq_values];
      const float* vb = &v[b * seq_values];
      for (int g = 0; g < s.kv_heads; ++g) {
        const std::size_t kv = static_cast<std::size_t>(g) * dim;
        for (int t = 0; t < s.tokens; ++t) {
          const float* kt = &kb[t * row + kv];
          for (int h = 0; h < group; ++h) {
            const float* qh = &q[(g * group + h) * dim];
            float d[8] = {};
            for (std::size_t c = 0; c < dim; c += 8) {
              for (int j = 0; j < 8; ++j) d[j] += qh[c + j] * kt[c + j];
            }
            p[h * s.tokens + t] = (((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]))) * scale;
          }
        }
        std::vector<float> sums(group);
        for (int h = 0; h < group; ++h) {
          float* ph = &p[h * s.tokens];
          const float max = *std::max_element(ph, ph + s.tokens);
          for (int t = 0; t < s.tokens; ++t) sums[h] += (ph[t] = std::exp(ph[t] - max));
          float* o = &out[(g * group + h) * dim];
          std::fill(o, o + dim, 0.0f);
        }
        for (int t = 0; t < s.tokens; ++t) {
          const float* vt = &vb[t * row + kv];
          for (int h = 0; h < group; ++h) {
            const float w = p[h * s.tokens + t];
            float* o = &out[(g * group + h) * dim];
            for (std::size_t c = 0; c < dim; ++c) o[c] += w * vt[c];
          }
        }
        for (int h = 0; h < group; ++h) {
          float* o = &out[(g * group + h) * dim];
          for (std::size_t c = 0; c < dim; ++c) o[c] /= sums[h];
        }
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double bytes = 2.0 * static_cast<double>(k.size()) * sizeof(float);
  state.SetLabel(std::string(s.name) + "|dense fp32|1");
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(s.tokens) * s.batch * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes/s"] = benchmark::Counter(bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = bytes;
}
BENCHMARK(BM_DenseFp32)->ArgName("shape")->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// One thread summing 256 MiB of floats: the read rate a single-threaded
// decode call can hope for on this machine.
void BM_ReadBandwidth(benchmark::State& state) {
  std::vector<float> buffer((std::size_t{256} << 20) / sizeof(float), 1.0f);
  for (auto _ : state) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, s4 = 0.0f, s5 = 0.0f, s6 = 0.0f, s7 = 0.0f;
    for (std::size_t i = 0; i < buffer.size(); i += 8) {
      s0 += buffer[i];
      s1 += buffer[i + 1];
      s2 += buffer[i + 2];
      s3 += buffer[i + 3];
      s4 += buffer[i + 4];
      s5 += buffer[i + 5];
      s6 += buffer[i + 6];
      s7 += buffer[i + 7];
    }
    benchmark::DoNotOptimize(s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7);
  }
  state.counters["bytes/s"] = benchmark::Counter(
      static_cast<double>(buffer.size()) * sizeof(float) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ReadBandwidth)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"shape", "plan", "threads"})
    ->ArgsProduct({{0, 1, 2}, {0, 1, 2, 3}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace mixkv

BENCHMARK_MAIN();
