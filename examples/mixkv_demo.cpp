// mixkv-demo: a synthetic video-QA workload stored through the cache manager
// under WindowQuant plans, on the CUDA backend when mixkv was built with it
// and a GPU is present (`--cpu` forces the CPU backend), else on the CPU.
//
// Each request is (system text, F frames x 196 visual tokens, question). The
// question is about a few frames: their visual embeddings lean towards the
// question's direction, and their keys lean towards the decode queries', so
// that (as in a real model) the windows the planner keeps in FP16 are the
// ones attention looks at. Keys carry a few outlier channels. The demo plans
// every request, stores its K/V through KVCacheManager and store_prefill,
// runs decode attention for every layer (on the GPU: the whole batch in one
// DecodePlan, one launch a layer), and compares each storage choice (all
// INT4, all INT2, WindowQuant) with an all-FP16 cache of the same tokens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/half.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/store.h"
#include "mixkv/planner/window_planner.h"

#if defined(MIXKV_DEMO_CUDA)
#include <cuda_runtime_api.h>

#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/store.h"
#endif

namespace {

using namespace mixkv;

constexpr int kTokensPerFrame = 196;
constexpr int kHidden = 256;     // embedding width used for planning
constexpr int kQueryHeads = 28;  // Qwen2-7B-like GQA 7:1
constexpr int kOutlierChannels = 4;

struct Request {
  TokenLayout layout;
  std::vector<float> embeddings;        // [tokens][kHidden]
  std::vector<std::vector<Half>> k, v;  // [layer] -> [tokens][kv_heads][head_dim]
  std::vector<std::vector<Half>> q;     // [layer] -> [q_heads][head_dim]
};

std::vector<float> random_direction(std::mt19937& rng, int n) {
  std::normal_distribution<float> normal;
  std::vector<float> d(n);
  for (float& x : d) x = normal(rng);
  return d;
}

Request make_request(std::mt19937& rng, const CacheShape& shape, int frames, int relevant_first, int relevant_count) {
  const int system_tokens = 24, question_tokens = 40;
  Request r;
  r.layout = TokenLayout({{TokenKind::Text, system_tokens},
                          {TokenKind::Visual, frames * kTokensPerFrame},
                          {TokenKind::Text, question_tokens}});
  const int n = r.layout.num_tokens();
  const int d = shape.head_dim, h = shape.num_kv_heads;
  std::normal_distribution<float> normal;
  const auto topic = random_direction(rng, kHidden);
  auto is_relevant = [&](int token) {
    const int frame = (token - system_tokens) / kTokensPerFrame;
    return token >= system_tokens && token < system_tokens + frames * kTokensPerFrame && frame >= relevant_first &&
           frame < relevant_first + relevant_count;
  };
  auto is_question = [&](int token) { return token >= n - question_tokens; };

  r.embeddings.resize(static_cast<std::size_t>(n) * kHidden);
  for (int t = 0; t < n; ++t) {
    // Similarity to the question falls off smoothly with distance from the
    // relevant frames, giving the planner a spread of scores.
    const int frame = (t - system_tokens) / kTokensPerFrame;
    float lean = 0.0f;
    if (t < system_tokens || is_question(t))
      lean = 4.0f;
    else if (is_relevant(t))
      lean = 6.0f;
    else if (t >= system_tokens && t < system_tokens + frames * kTokensPerFrame)
      lean = 1.5f * std::exp(-std::abs(frame - relevant_first) / 2.0f);
    for (int c = 0; c < kHidden; ++c)
      r.embeddings[static_cast<std::size_t>(t) * kHidden + c] = lean * topic[c] + normal(rng);
  }

  // Keys: Gaussian, a few outlier channels (sd 10, mean +-5), and relevant
  // tokens tilted towards the query direction so attention concentrates there.
  r.k.resize(shape.num_layers);
  r.v.resize(shape.num_layers);
  r.q.resize(shape.num_layers);
  std::uniform_int_distribution<int> channel(0, d - 1);
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    std::vector<int> outliers(kOutlierChannels);
    for (int& c : outliers) c = channel(rng);
    const auto query_dir = random_direction(rng, d);
    auto& k = r.k[layer];
    auto& v = r.v[layer];
    k.resize(static_cast<std::size_t>(n) * h * d);
    v.resize(k.size());
    for (int t = 0; t < n; ++t)
      for (int head = 0; head < h; ++head)
        for (int c = 0; c < d; ++c) {
          float kv = normal(rng);
          for (int i = 0; i < kOutlierChannels; ++i)
            if (outliers[i] == c) kv = (i % 2 ? -5.0f : 5.0f) + 10.0f * normal(rng);
          if (is_relevant(t)) kv += 0.35f * query_dir[c];
          const std::size_t at = (static_cast<std::size_t>(t) * h + head) * d + c;
          k[at] = float_to_half(kv);
          v[at] = float_to_half(normal(rng));
        }
    auto& q = r.q[layer];
    q.resize(static_cast<std::size_t>(kQueryHeads) * d);
    for (int head = 0; head < kQueryHeads; ++head)
      for (int c = 0; c < d; ++c)
        q[static_cast<std::size_t>(head) * d + c] = float_to_half(query_dir[c] + 0.3f * normal(rng));
  }
  return r;
}

// One storage choice: the requests' tokens under its plans, in its own
// arena (host memory on the CPU backend, one cudaMalloc on the CUDA one).
struct Variant {
  const char* name = "";
  std::vector<PrecisionPlan> plans;
  std::unique_ptr<KVCacheManager> manager;
  std::vector<std::byte> arena;
#if defined(MIXKV_DEMO_CUDA)
  std::unique_ptr<gpu::DeviceArena> device_arena;
#endif
  double error_sum = 0, error_max = 0;
};

// Decode attention outputs, [request][layer] -> [q_heads][head_dim].
using Outputs = std::vector<std::vector<std::vector<float>>>;

float sm_scale(const CacheShape& shape) { return 1.0f / std::sqrt(static_cast<float>(shape.head_dim)); }

class CpuBackend {
 public:
  std::string name() const { return "CPU backend"; }

  void allocate(Variant& v) const { v.arena.resize(v.manager->config().arena_bytes); }

  void store(Variant& v, SequenceId id, const Request& r) const {
    const PoolViews pools = views(v);
    for (int layer = 0; layer < v.manager->config().shape.num_layers; ++layer)
      cpu::store_prefill(r.k[layer], r.v[layer], v.manager->prefill_mapping(id, layer), pools);
  }

  Outputs attend(Variant& v, const std::vector<Request>& requests) const {
    const CacheShape& shape = v.manager->config().shape;
    const PoolViews pools = views(v);
    Outputs outputs(requests.size());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const SequenceId ids[] = {static_cast<SequenceId>(i)};
      const DecodeMetadata meta = v.manager->decode_metadata(ids);
      for (int layer = 0; layer < shape.num_layers; ++layer) {
        std::vector<float> out(static_cast<std::size_t>(kQueryHeads) * shape.head_dim), lse(kQueryHeads);
        cpu::decode_attention({.q = requests[i].q[layer],
                               .num_q_heads = kQueryHeads,
                               .sm_scale = sm_scale(shape),
                               .tables = &meta.layers[layer],
                               .pools = pools,
                               .out = out,
                               .lse = lse});
        outputs[i].push_back(std::move(out));
      }
    }
    return outputs;
  }

 private:
  static PoolViews views(Variant& v) {
    PoolViews pools;
    for (Precision p : kAllPrecisions) pools[pool_index(p)] = v.manager->pool_view(p, v.arena.data());
    return pools;
  }
};

#if defined(MIXKV_DEMO_CUDA)
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t count) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
    data_.reset(static_cast<T*>(p));
  }
  T* get() const { return data_.get(); }
  void upload(const std::vector<T>& host) {
    cuda_check(cudaMemcpy(get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download(std::size_t count) const {
    std::vector<T> host(count);
    cuda_check(cudaMemcpy(host.data(), get(), count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  struct Free {
    void operator()(T* p) const { cudaFree(p); }
  };
  std::unique_ptr<T, Free> data_;
};

// The pools in device memory; each layer's K/V stored by one store_prefill
// launch; the whole batch's decode attention planned once (DecodePlan over
// DevicePageTables) and run as one launch a layer.
class CudaBackend {
 public:
  std::string name() const {
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    return std::string("CUDA backend, ") + prop.name;
  }

  void allocate(Variant& v) const {
    v.device_arena = std::make_unique<gpu::DeviceArena>(v.manager->config().arena_bytes);
  }

  void store(Variant& v, SequenceId id, const Request& r) {
    const CacheShape& shape = v.manager->config().shape;
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      DeviceArray<Half> k(r.k[layer].size()), values(r.v[layer].size());
      k.upload(r.k[layer]);
      values.upload(r.v[layer]);
      mapping_.upload(v.manager->prefill_mapping(id, layer), shape.block_size, nullptr);
      gpu::StorePrefillArgs args;
      mapping_.fill(args);
      args.k = k.get();
      args.v = values.get();
      args.pools = v.device_arena->pool_views(v.manager->arena_layout());
      gpu::store_prefill(args);
      cuda_check(cudaDeviceSynchronize(), "store_prefill");
    }
  }

  Outputs attend(Variant& v, const std::vector<Request>& requests) const {
    const CacheShape& shape = v.manager->config().shape;
    const auto batch = static_cast<std::int32_t>(requests.size());
    std::vector<SequenceId> ids;
    std::vector<std::int32_t> slots;
    for (std::int32_t i = 0; i < batch; ++i) ids.push_back(i), slots.push_back(i);
    // The page tables hold each (sequence, layer, pool)'s longest list.
    const DecodeMetadata meta = v.manager->decode_metadata(ids);
    std::int32_t longest = 1;
    for (const auto& layer : meta.layers)
      for (const PagedPoolTable& table : layer)
        for (std::int32_t i = 0; i < batch; ++i) longest = std::max(longest, table.indptr[i + 1] - table.indptr[i]);
    gpu::DevicePageTables tables(
        {.num_layers = shape.num_layers, .max_sequences = batch, .max_blocks_per_sequence = longest},
        v.manager->arena_layout());
    for (std::int32_t i = 0; i < batch; ++i) tables.sync(slots[i], v.manager->page_table(ids[i]));
    tables.upload(nullptr);
    gpu::DecodePlan plan({.num_layers = shape.num_layers,
                          .num_q_heads = kQueryHeads,
                          .num_kv_heads = shape.num_kv_heads,
                          .head_dim = shape.head_dim,
                          .block_size = shape.block_size,
                          .max_batch = batch},
                         tables);
    plan.plan(slots, nullptr);
    const std::size_t row = static_cast<std::size_t>(kQueryHeads) * shape.head_dim;
    DeviceArray<Half> q(batch * row), out(batch * row);
    Outputs outputs(requests.size());
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      std::vector<Half> host_q;
      for (const Request& r : requests) host_q.insert(host_q.end(), r.q[layer].begin(), r.q[layer].end());
      q.upload(host_q);
      plan.run({.layer = layer,
                .q = q.get(),
                .out = out.get(),
                .sm_scale = sm_scale(shape),
                .pools = v.device_arena->pool_views(v.manager->arena_layout())});
      const std::vector<Half> host_out = out.download(batch * row);
      for (std::int32_t i = 0; i < batch; ++i) {
        std::vector<float>& o = outputs[i].emplace_back(row);
        for (std::size_t j = 0; j < row; ++j) o[j] = half_to_float(host_out[i * row + j]);
      }
    }
    return outputs;
  }

 private:
  gpu::DeviceStoreMapping mapping_;
};
#endif

double relative_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    num += (out[i] - ref[i]) * double(out[i] - ref[i]);
    den += ref[i] * double(ref[i]);
  }
  return std::sqrt(num / den);
}

std::string mib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MiB", bytes / (1024.0 * 1024.0));
  return text;
}

template <typename Backend>
void run_demo(Backend& backend, int num_requests) {
  const CacheShape shape{.num_layers = 4, .num_kv_heads = 4, .head_dim = 128, .block_size = 32};
  std::mt19937 rng(2026);

  // Layer sensitivities as eq. 9 would measure them: early layers change the
  // hidden state most (low s_l), so they keep more windows at high precision.
  PlannerConfig planner_config;
  planner_config.window_size = shape.block_size;
  planner_config.sensitivities = {0.3, 0.5, 0.7, 0.85};
  const WindowPlanner planner(planner_config);

  std::vector<Request> requests;
  for (int i = 0; i < num_requests; ++i) {
    const int frames = 8 + 4 * (i % 3);
    requests.push_back(make_request(rng, shape, frames, /*relevant_first=*/1 + i % (frames - 3),
                                    /*relevant_count=*/2));
  }

  // One cache per storage choice, each with its own arena, the same tokens.
  std::vector<Variant> variants;
  for (const char* name : {"FP16", "INT4", "INT2", "WindowQuant"}) variants.emplace_back().name = name;
  for (const Request& r : requests) {
    const int windows = r.layout.num_windows(shape.block_size);
    const EmbeddingsView view{r.embeddings.data(), ElementType::F32, r.layout.num_tokens(), kHidden};
    variants[0].plans.emplace_back(shape.num_layers, windows, Precision::FP16);
    variants[1].plans.emplace_back(shape.num_layers, windows, Precision::INT4);
    variants[2].plans.emplace_back(shape.num_layers, windows, Precision::INT2);
    variants[3].plans.push_back(planner.plan(r.layout, view));
  }
  const std::size_t slab_bytes = 2u << 20;
  for (Variant& variant : variants) {
    BlockCounts need{};
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const PlanStats stats = plan_stats(requests[i].layout, variant.plans[i], shape);
      for (int p = 0; p < kNumPrecisions; ++p) need[p] += stats.blocks[p];
    }
    // Enough slabs for the demand of each pool, rounded up per pool.
    std::size_t slabs = 0;
    for (Precision p : kAllPrecisions) {
      const std::size_t per_slab =
          slab_bytes / BlockFormat{p, shape.num_kv_heads, shape.head_dim, shape.block_size}.block_bytes();
      slabs += (need[pool_index(p)] + per_slab - 1) / per_slab;
    }
    variant.manager = std::make_unique<KVCacheManager>(
        CacheConfig{.shape = shape, .arena_bytes = slabs * slab_bytes, .slab_bytes = slab_bytes});
    backend.allocate(variant);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      variant.manager->add_sequence(static_cast<SequenceId>(i), requests[i].layout, variant.plans[i]);
      backend.store(variant, static_cast<SequenceId>(i), requests[i]);
    }
    variant.manager->check_invariants();
  }

  // Attention of every request and layer against the FP16 cache.
  std::vector<Outputs> outputs;
  for (Variant& variant : variants) outputs.push_back(backend.attend(variant, requests));
  int samples = 0;
  for (std::size_t i = 0; i < requests.size(); ++i)
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      for (std::size_t v = 1; v < variants.size(); ++v) {
        const double e = relative_error(outputs[v][i][layer], outputs[0][i][layer]);
        variants[v].error_sum += e;
        variants[v].error_max = std::max(variants[v].error_max, e);
      }
      ++samples;
    }

  int total_tokens = 0, total_windows = 0;
  for (const Request& r : requests) {
    total_tokens += r.layout.num_tokens();
    total_windows += r.layout.num_windows(shape.block_size);
  }
  std::printf(
      "mixkv-demo: %d requests, %d tokens (%d visual windows of %d), %d layers, %d KV heads x %d, "
      "GQA %d:%d, %s\n\n",
      num_requests, total_tokens, total_windows, shape.block_size, shape.num_layers, shape.num_kv_heads, shape.head_dim,
      kQueryHeads, shape.num_kv_heads, backend.name().c_str());
  std::printf("WindowQuant plan: per-layer thresholds (alpha %.1f)\n", planner_config.alpha);
  for (int l = 0; l < shape.num_layers; ++l)
    std::printf("  layer %d: s_l %.2f  T_low %.3f  T_high %.3f\n", l, planner_config.sensitivities[l],
                planner.thresholds()[l].low, planner.thresholds()[l].high);

  const Variant& wq = variants[3];
  std::printf("\n%-6s %10s %12s %14s\n", "pool", "blocks", "block bytes", "bytes");
  double fp16_bytes = 0, wq_bytes = 0;
  for (Precision p : kAllPrecisions) {
    const PoolStats s = wq.manager->pool_stats(p);
    wq_bytes += double(s.used_blocks) * s.block_bytes;
    std::printf("%-6s %10lld %12zu %14s\n", std::string(to_string(p)).c_str(), static_cast<long long>(s.used_blocks),
                s.block_bytes, mib(double(s.used_blocks) * s.block_bytes).c_str());
  }
  const PoolStats fp16 = variants[0].manager->pool_stats(Precision::FP16);
  fp16_bytes = double(fp16.used_blocks) * fp16.block_bytes;
  std::printf("%-6s %10s %12s %14s\n", "total", "", "", mib(wq_bytes).c_str());
  std::printf("\nall-FP16 cache: %s; WindowQuant: %s = %.3fx of FP16 (%.1f%% saved)\n\n", mib(fp16_bytes).c_str(),
              mib(wq_bytes).c_str(), wq_bytes / fp16_bytes, 100.0 * (1.0 - wq_bytes / fp16_bytes));

  std::printf("%-12s %12s %10s %22s %20s\n", "storage", "KV bytes", "x FP16", "attn error mean (rel)",
              "attn error max");
  for (std::size_t v = 0; v < variants.size(); ++v) {
    double bytes = 0;
    for (Precision p : kAllPrecisions) {
      const PoolStats s = variants[v].manager->pool_stats(p);
      bytes += double(s.used_blocks) * s.block_bytes;
    }
    std::printf("%-12s %12s %10.3f %22.4f %20.4f\n", variants[v].name, mib(bytes).c_str(), bytes / fp16_bytes,
                v == 0 ? 0.0 : variants[v].error_sum / samples, variants[v].error_max);
  }
}

}  // namespace

// mixkv-demo [requests] [--cpu]
int main(int argc, char** argv) {
  int num_requests = 4;
  bool force_cpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--cpu") {
      force_cpu = true;
    } else if (const int n = std::atoi(argv[i]); n > 0) {
      num_requests = n;
    } else {
      std::fprintf(stderr, "mixkv-demo: unknown argument '%s' (usage: mixkv-demo [requests] [--cpu])\n", argv[i]);
      return 2;
    }
  }
#if defined(MIXKV_DEMO_CUDA)
  if (!force_cpu && gpu::cuda_device_available()) {
    CudaBackend backend;
    run_demo(backend, num_requests);
    return 0;
  }
#endif
  (void)force_cpu;
  CpuBackend backend;
  run_demo(backend, num_requests);
  return 0;
}
