// Serving simulation at a fixed memory budget: 141 GB of H200 memory minus
// 15 GB of Qwen2-7B weights = 126 GB of KV arena (bookkeeping only: no
// bytes are touched), Qwen2-7B shapes (28 layers, 4 KV heads, head_dim 128,
// window 32), requests arriving as a Poisson process, one engine step per
// time unit. Two traces:
//  - video QA: 100-frame requests (14 system tokens, 100 x 196 visual
//    tokens, a 10-40 token question, 32-512 new tokens), the same arrivals
//    under three plans: all FP16, a WindowQuant plan (window 0 FP16, then
//    per layer ~10% FP16 / 30% INT4 / 60% INT2 by similarity score) and
//    uniform INT4 (window 0 FP16);
//  - text only: 1-8k-token prompts and 128-1,024 new tokens, the same
//    arrivals all FP16 and under age tiers (SchedulerConfig::age_tiers: the
//    first and the 4 most recent windows FP16, older ones INT4, or INT4 in
//    17 layers and INT2 in 11).
// Reports concurrent requests, KV bytes per running request, preemptions
// and decode tokens per step, as JSON:
//
//   serving_sim [out.json] [text]   (benchmarks/results/serving-sim.json; docs/serving-sim.md;
//                                    "text": the text-only trace alone)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "mixkv/scheduler/scheduler.h"

namespace mixkv {
namespace {

constexpr std::int32_t kLayers = 28;
constexpr std::int32_t kFrames = 100;
constexpr std::int32_t kTokensPerFrame = 196;
constexpr std::int32_t kRequests = 1500;
constexpr double kArrivalsPerStep = 2.0;
constexpr std::int32_t kTextRequests = 3000;
constexpr double kTextArrivalsPerStep = 4.0;

enum class PlanKind { FP16, WindowQuant, INT4 };

const char* name(PlanKind k) {
  return k == PlanKind::FP16 ? "all FP16" : (k == PlanKind::WindowQuant ? "WindowQuant" : "uniform INT4");
}

struct Arrival {
  std::int64_t step;
  std::int32_t question;
  std::int32_t max_new;
  std::uint32_t seed;
};

std::vector<Arrival> arrivals() {
  std::mt19937 rng(2024);
  std::exponential_distribution<double> gap(kArrivalsPerStep);
  std::uniform_int_distribution<int> question(10, 40);
  std::uniform_int_distribution<int> max_new(32, 512);
  std::vector<Arrival> out;
  double t = 0.0;
  for (int i = 0; i < kRequests; ++i) {
    t += gap(rng);
    out.push_back({static_cast<std::int64_t>(t), question(rng), max_new(rng), static_cast<std::uint32_t>(rng())});
  }
  return out;
}

// Text-only arrivals: Arrival::question holds the prompt length.
std::vector<Arrival> text_arrivals() {
  std::mt19937 rng(2025);
  std::exponential_distribution<double> gap(kTextArrivalsPerStep);
  std::uniform_int_distribution<int> prompt(1024, 8192);
  std::uniform_int_distribution<int> max_new(128, 1024);
  std::vector<Arrival> out;
  double t = 0.0;
  for (int i = 0; i < kTextRequests; ++i) {
    t += gap(rng);
    out.push_back({static_cast<std::int64_t>(t), prompt(rng), max_new(rng), static_cast<std::uint32_t>(rng())});
  }
  return out;
}

enum class TierKind { Off, Int4, Int4Int2 };

const char* name(TierKind k) {
  return k == TierKind::Off ? "text, all FP16"
                            : (k == TierKind::Int4 ? "text, age tiers INT4" : "text, age tiers INT4/INT2");
}

Request make_text(RequestId id, const Arrival& a) {
  Request r;
  r.id = id;
  r.layout = TokenLayout({{TokenKind::Text, a.question}});
  r.max_new_tokens = a.max_new;
  r.arrival_time = static_cast<double>(a.step);
  return r;
}

Request make(RequestId id, const Arrival& a, PlanKind kind) {
  Request r;
  r.id = id;
  r.layout = TokenLayout(
      {{TokenKind::Text, 14}, {TokenKind::Visual, kFrames * kTokensPerFrame}, {TokenKind::Text, a.question}});
  const std::int32_t windows = r.layout.num_windows(32);
  PrecisionPlan plan(kLayers, windows, kind == PlanKind::INT4 ? Precision::INT4 : Precision::FP16);
  std::mt19937 rng(a.seed);
  std::uniform_real_distribution<float> score(0.0f, 1.0f);
  std::vector<float> scores(static_cast<std::size_t>(windows));
  for (std::int32_t w = 0; w < windows; ++w) {
    scores[static_cast<std::size_t>(w)] = score(rng);
    plan.set_score(w, scores[static_cast<std::size_t>(w)]);
  }
  if (kind == PlanKind::WindowQuant) {
    // Per layer, thresholds that put ~10% of the windows above T_high and
    // ~60% below T_low, shifted a little per layer (layer sensitivity).
    for (std::int32_t l = 0; l < kLayers; ++l) {
      const float shift = 0.05f * static_cast<float>((l % 5) - 2);
      for (std::int32_t w = 1; w < windows; ++w) {
        const float s = scores[static_cast<std::size_t>(w)] + shift;
        plan.set(l, w, s > 0.9f ? Precision::FP16 : (s < 0.6f ? Precision::INT2 : Precision::INT4));
      }
    }
  }
  for (std::int32_t l = 0; l < kLayers; ++l) plan.set(l, 0, Precision::FP16);
  r.plan = std::move(plan);
  r.max_new_tokens = a.max_new;
  r.arrival_time = static_cast<double>(a.step);
  return r;
}

struct Series {
  std::vector<std::int32_t> running, waiting;
  std::vector<std::int64_t> preemptions;
  std::vector<std::int32_t> decode_tokens;
  std::vector<double> used_gb;
};

SchedulerConfig base_config() {
  SchedulerConfig sc;
  sc.max_num_seqs = 1024;
  sc.max_num_batched_tokens = 32768;
  sc.watermark = 0.0;  // admission fills memory to the top: growth must preempt (or demote)
  sc.build_metadata = false;
  sc.build_mappings = false;
  return sc;
}

// Runs `work` to the end, request i made by make_request(i).
template <typename Make>
std::string simulate(const char* label, const SchedulerConfig& sc, const std::vector<Arrival>& work,
                     Make&& make_request) {
  CacheConfig cc;
  cc.shape = CacheShape{kLayers, 4, 128, 32};
  cc.arena_bytes = std::size_t{126} * 1000 * 1000 * 1000;
  cc.fp16_windows_first = true;
  KVCacheManager cache(cc);
  Scheduler sched(cache, sc);
  Series s;
  double bytes_per_request = 0.0;  // KV bytes per running request, summed over steps with any
  std::int64_t loaded_steps = 0;
  std::size_t next = 0;
  std::int64_t step = 0;
  std::int64_t decoded = 0;
  std::int32_t peak = 0;
  double running_sum = 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  while (next < work.size() || sched.has_unfinished()) {
    while (next < work.size() && work[next].step <= step) {
      sched.add_request(make_request(next));
      ++next;
    }
    const StepOutput out = sched.step();
    const SchedulerStats st = sched.stats();
    s.running.push_back(st.running + st.prefilling);
    s.waiting.push_back(st.waiting + st.swapped);
    s.preemptions.push_back(st.preempted_recompute + st.preempted_swap);
    s.decode_tokens.push_back(static_cast<std::int32_t>(out.decodes.size()));
    double used = 0.0;
    for (const Precision p : kAllPrecisions) {
      const PoolStats ps = cache.pool_stats(p);
      used += static_cast<double>(ps.used_blocks) * static_cast<double>(ps.block_bytes);
    }
    s.used_gb.push_back(used / 1e9);
    if (st.running + st.prefilling > 0) {
      bytes_per_request += used / (st.running + st.prefilling);
      ++loaded_steps;
    }
    decoded += static_cast<std::int64_t>(out.decodes.size());
    peak = std::max(peak, st.running + st.prefilling);
    running_sum += st.running + st.prefilling;
    ++step;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const SchedulerStats st = sched.stats();
  const double mb_per_request = bytes_per_request / std::max<std::int64_t>(loaded_steps, 1) / 1e6;
  std::fprintf(stderr,
               "%-26s steps %lld, mean concurrent %.1f, peak %d, KV MB per running request %.1f, preemptions %lld "
               "(recompute), demotions %lld, age demotions %lld, decode tokens/step %.1f, rejected %lld, %.1f s "
               "host\n",
               label, static_cast<long long>(step), running_sum / step, peak, mb_per_request,
               static_cast<long long>(st.preempted_recompute), static_cast<long long>(st.demotions),
               static_cast<long long>(st.age_demotions), static_cast<double>(decoded) / step,
               static_cast<long long>(st.rejected), secs);
  auto list = [](const auto& v) {
    std::string o = "[";
    for (std::size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + std::to_string(v[i]);
    return o + "]";
  };
  char summary[512];
  std::snprintf(summary, sizeof summary,
                "\"steps\": %lld, \"mean_concurrent\": %.2f, \"peak_concurrent\": %d, \"preemptions\": %lld, "
                "\"demotions\": %lld, \"age_demotions\": %lld, \"kv_mb_per_running_request\": %.1f, "
                "\"decode_tokens_per_step\": %.2f, \"finished\": %lld, \"rejected\": %lld",
                static_cast<long long>(step), running_sum / step, peak, static_cast<long long>(st.preempted_recompute),
                static_cast<long long>(st.demotions), static_cast<long long>(st.age_demotions), mb_per_request,
                static_cast<double>(decoded) / step, static_cast<long long>(st.finished),
                static_cast<long long>(st.rejected));
  std::vector<double> gb;
  for (double g : s.used_gb) gb.push_back(static_cast<double>(static_cast<long long>(g * 10)) / 10);
  return std::string("{\"plan\": \"") + label + "\", " + summary + ", \"running\": " + list(s.running) +
         ", \"waiting\": " + list(s.waiting) + ", \"preemptions_cumulative\": " + list(s.preemptions) +
         ", \"decode_tokens\": " + list(s.decode_tokens) + ", \"used_gb_x10\": " +
         [&] {
           std::vector<long long> v;
           for (double g : s.used_gb) v.push_back(static_cast<long long>(g * 10));
           return list(v);
         }() +
         "}";
}

std::string run(PlanKind kind, const std::vector<Arrival>& work) {
  SchedulerConfig sc = base_config();
  sc.demote_under_pressure = kind == PlanKind::WindowQuant;  // mixkv's own; FP16 and INT4 stay as planned
  return simulate(name(kind), sc, work, [&](std::size_t i) { return make(static_cast<RequestId>(i), work[i], kind); });
}

// Text-only requests: nothing to plan; the tiers demote their old windows.
std::string run_text(TierKind kind, const std::vector<Arrival>& work) {
  SchedulerConfig sc = base_config();
  sc.max_num_seqs = 4096;  // memory, not the slot count, bounds the batch
  if (kind != TierKind::Off) {
    sc.age_tiers.enabled = true;
    sc.age_tiers.sink_windows = 1;
    sc.age_tiers.recent_windows = 4;
    sc.age_tiers.layer_floor.assign(kLayers, Precision::INT4);
    // The real-model split of docs/real-model.md's plans: 17 INT4 layers, 11 INT2.
    if (kind == TierKind::Int4Int2) {
      for (std::int32_t l = 17; l < kLayers; ++l)
        sc.age_tiers.layer_floor[static_cast<std::size_t>(l)] = Precision::INT2;
    }
  }
  return simulate(name(kind), sc, work, [&](std::size_t i) { return make_text(static_cast<RequestId>(i), work[i]); });
}

}  // namespace
}  // namespace mixkv

int main(int argc, char** argv) {
  using namespace mixkv;
  const bool text_only = argc > 2 && std::string(argv[2]) == "text";
  std::string json = "{\"arena_gb\": 126, \"requests\": " + std::to_string(kRequests) +
                     ", \"arrivals_per_step\": " + std::to_string(kArrivalsPerStep) + ", \"runs\": [";
  bool first = true;
  for (const PlanKind k : {PlanKind::FP16, PlanKind::WindowQuant, PlanKind::INT4}) {
    if (text_only) break;
    json += (first ? "" : ", ") + run(k, arrivals());
    first = false;
  }
  json += "], \"text_requests\": " + std::to_string(kTextRequests) +
          ", \"text_arrivals_per_step\": " + std::to_string(kTextArrivalsPerStep) + ", \"text_runs\": [";
  first = true;
  for (const TierKind k : {TierKind::Off, TierKind::Int4, TierKind::Int4Int2}) {
    json += (first ? "" : ", ") + run_text(k, text_arrivals());
    first = false;
  }
  json += "]}\n";
  if (argc > 1) {
    std::ofstream(argv[1]) << json;
  } else {
    std::fputs(json.c_str(), stdout);
  }
  return 0;
}
