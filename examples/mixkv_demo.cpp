// mixkv-demo: a synthetic video-QA workload stored through the cache manager
// under WindowQuant plans, on the CPU backend.
//
// Each request is (system text, F frames x 196 visual tokens, question). The
// question is about a few frames: their visual embeddings lean towards the
// question's direction, and their keys lean towards the decode queries', so
// that (as in a real model) the windows the planner keeps in FP16 are the
// ones attention looks at. Keys carry a few outlier channels. The demo plans
// every request, stores its K/V through KVCacheManager + cpu::store_prefill,
// runs decode attention for every layer, and compares each storage choice
// (all INT4, all INT2, WindowQuant) with an all-FP16 cache of the same tokens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "mixkv/cache/half.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/cache/window_planner.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/store.h"

namespace {

using namespace mixkv;

constexpr int kTokensPerFrame = 196;
constexpr int kHidden = 256;       // embedding width used for planning
constexpr int kQueryHeads = 28;    // Qwen2-7B-like GQA 7:1
constexpr int kOutlierChannels = 4;

struct Request {
  TokenLayout layout;
  std::vector<float> embeddings;          // [tokens][kHidden]
  std::vector<std::vector<Half>> k, v;    // [layer] -> [tokens][kv_heads][head_dim]
  std::vector<std::vector<Half>> q;       // [layer] -> [q_heads][head_dim]
};

std::vector<float> random_direction(std::mt19937& rng, int n) {
  std::normal_distribution<float> normal;
  std::vector<float> d(n);
  for (float& x : d) x = normal(rng);
  return d;
}

Request make_request(std::mt19937& rng, const CacheShape& shape, int frames, int relevant_first,
                     int relevant_count) {
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
    return token >= system_tokens && token < system_tokens + frames * kTokensPerFrame &&
           frame >= relevant_first && frame < relevant_first + relevant_count;
  };
  auto is_question = [&](int token) { return token >= n - question_tokens; };

  r.embeddings.resize(static_cast<std::size_t>(n) * kHidden);
  for (int t = 0; t < n; ++t) {
    // Similarity to the question falls off smoothly with distance from the
    // relevant frames, giving the planner a spread of scores.
    const int frame = (t - system_tokens) / kTokensPerFrame;
    float lean = 0.0f;
    if (t < system_tokens || is_question(t)) lean = 4.0f;
    else if (is_relevant(t)) lean = 6.0f;
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

// Decode attention of one request in one layer; returns [q_heads][head_dim].
std::vector<float> attend(KVCacheManager& manager, std::vector<std::byte>& arena, SequenceId id, int layer,
                          const std::vector<Half>& q) {
  const CacheShape& shape = manager.config().shape;
  const SequenceId ids[] = {id};
  const DecodeMetadata meta = manager.decode_metadata(ids);
  cpu::PoolViews pools;
  for (Precision p : kAllPrecisions) pools[pool_index(p)] = manager.pool_view(p, arena.data());
  std::vector<float> out(static_cast<std::size_t>(kQueryHeads) * shape.head_dim), lse(kQueryHeads);
  cpu::decode_attention({.q = q,
                         .num_q_heads = kQueryHeads,
                         .sm_scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim)),
                         .tables = &meta.layers[layer],
                         .pools = pools,
                         .out = out,
                         .lse = lse});
  return out;
}

void store(KVCacheManager& manager, std::vector<std::byte>& arena, SequenceId id, const Request& r) {
  cpu::PoolViews pools;
  for (Precision p : kAllPrecisions) pools[pool_index(p)] = manager.pool_view(p, arena.data());
  for (int layer = 0; layer < manager.config().shape.num_layers; ++layer)
    cpu::store_prefill(r.k[layer], r.v[layer], manager.prefill_mapping(id, layer), pools);
}

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

}  // namespace

int main(int argc, char** argv) {
  const int num_requests = argc > 1 ? std::max(1, std::atoi(argv[1])) : 4;
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
  struct Variant {
    const char* name;
    std::vector<PrecisionPlan> plans;
    std::unique_ptr<KVCacheManager> manager;
    std::vector<std::byte> arena;
    double error_sum = 0, error_max = 0;
  };
  std::vector<Variant> variants;
  for (const char* name : {"FP16", "INT4", "INT2", "WindowQuant"}) variants.push_back({.name = name});
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
      const std::size_t per_slab = slab_bytes / BlockFormat{p, shape.num_kv_heads, shape.head_dim,
                                                            shape.block_size}.block_bytes();
      slabs += (need[pool_index(p)] + per_slab - 1) / per_slab;
    }
    variant.manager = std::make_unique<KVCacheManager>(
        CacheConfig{.shape = shape, .arena_bytes = slabs * slab_bytes, .slab_bytes = slab_bytes});
    variant.arena.resize(slabs * slab_bytes);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      variant.manager->add_sequence(static_cast<SequenceId>(i), requests[i].layout, variant.plans[i]);
      store(*variant.manager, variant.arena, static_cast<SequenceId>(i), requests[i]);
    }
    variant.manager->check_invariants();
  }

  // Attention of every request and layer against the FP16 cache.
  int samples = 0;
  for (std::size_t i = 0; i < requests.size(); ++i)
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const auto ref = attend(*variants[0].manager, variants[0].arena, static_cast<SequenceId>(i), layer,
                              requests[i].q[layer]);
      for (std::size_t v = 1; v < variants.size(); ++v) {
        const double e = relative_error(attend(*variants[v].manager, variants[v].arena,
                                               static_cast<SequenceId>(i), layer, requests[i].q[layer]),
                                        ref);
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
  std::printf("mixkv-demo: %d requests, %d tokens (%d visual windows of %d), %d layers, %d KV heads x %d, "
              "GQA %d:%d, CPU backend\n\n",
              num_requests, total_tokens, total_windows, shape.block_size, shape.num_layers,
              shape.num_kv_heads, shape.head_dim, kQueryHeads, shape.num_kv_heads);
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
    std::printf("%-6s %10lld %12zu %14s\n", std::string(to_string(p)).c_str(),
                static_cast<long long>(s.used_blocks), s.block_bytes, mib(double(s.used_blocks) * s.block_bytes).c_str());
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
  return 0;
}
