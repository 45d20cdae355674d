// Prefix caching in the serving simulation (docs/prefix-caching.md): the
// scheduler and the cache manager at serving_sim's budget (126 GB of KV
// arena, Qwen2-7B shapes, window 32, one engine step per time unit),
// bookkeeping only, on two traces:
//
// - video QA: N videos x M questions on average, each request a video drawn
//   by Zipf popularity; prompt = 64 system tokens | 100 frames x 196 visual
//   tokens | a 10-40 token question; visual keys are per-video content
//   hashes, text keys token ids.
// - shared system prompt: one 2,048-token system prompt, a distinct user
//   turn per request.
//
// Each trace runs with prefix caching off and on, under all-FP16 plans (a
// vLLM-like engine) and WindowQuant plans (one per question: a seeded
// score per window against per-layer thresholds, window 0 FP16), the
// latter with share_higher on and off. Reports prefill tokens computed and
// served from the cache, time to first token, cached videos held per GiB,
// decode tokens per step and output tokens per modelled GPU-second, as a
// table on stdout and JSON:
//
//   mixkv_prefix_sim [--quick] [--out PATH] [--rho R] [--sweep]
//
// --rho: correlation of a window's score between two questions about the
// same video (0, the default: independent plans per question; 1: one plan
// per video). --sweep adds the video trace's precision-aware runs at
// several rho (about 1 min each).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <boost/json.hpp>
#include <boost/json/src.hpp>

#include "mixkv/scheduler/scheduler.h"

namespace mixkv {
namespace {

namespace json = boost::json;

constexpr std::int32_t kLayers = 28;
constexpr std::int32_t kKvHeads = 4;
constexpr std::int32_t kHeadDim = 128;
constexpr std::int32_t kBlock = 32;
constexpr std::int32_t kQueryHidden = 28 * 128;  // query heads x head_dim
constexpr std::size_t kArenaBytes = std::size_t{126} * 1000 * 1000 * 1000;
// A multiple of the block size: the FP16 stream is closed where the video
// starts, so a cached prefix can reach into the video.
constexpr std::int32_t kSystemVideo = 64;
constexpr std::int32_t kFrames = 100;
constexpr std::int32_t kTokensPerFrame = 196;
constexpr std::int32_t kVisual = kFrames * kTokensPerFrame;
constexpr std::int32_t kSystemText = 2048;

// Step-time model (one H200, Qwen2-7B, roofline): a step takes the longer of
// its compute (2 x 7.6e9 FLOPs per row for the weights, plus causal
// attention 4 x layers x query hidden x context per row, at 50% of 989
// TFLOPS) and its memory traffic (15.2 GB of weights plus the KV bytes each
// decode row reads, at 80% of 4.8 TB/s). Prefill and decode rows of a step
// share one forward pass, as in chunked prefill.
constexpr double kParams = 7.6e9;
constexpr double kWeightBytes = 15.2e9;
constexpr double kFlops = 989e12 * 0.5;
constexpr double kBandwidth = 4.8e12 * 0.8;

enum class PlanKind { FP16, WindowQuant };

struct Variant {
  std::string name;
  PlanKind plans = PlanKind::FP16;
  bool prefix = false;
  bool share_higher = true;
  double rho = 0.0;
  bool demote = false;  // demotion under pressure: mixkv's own, so with WindowQuant plans only
  // PrefixIdentity::Content (with PrefillMode::Exact): blocks named by
  // content, a copy per precision, each question demoting to its own plan.
  bool content = false;
};

struct Arrival {
  std::int64_t step = 0;
  std::int32_t video = -1;    // -1: the text trace
  std::int32_t question = 0;  // the video's how-manieth question
  std::int32_t text = 0;      // question or user-turn tokens
  std::int32_t max_new = 1;
  std::uint32_t seed = 0;
};

struct Trace {
  std::string name;
  std::vector<Arrival> arrivals;
  std::int32_t videos = 0;
  double arrivals_per_step = 0.0;
  json::object config;
};

std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Requests drawn by Zipf(s) popularity over `videos` videos, Poisson
// arrivals; questions and answers of uniform length.
Trace video_trace(std::int32_t videos, std::int32_t questions, double zipf_s, double rate) {
  Trace t;
  t.name = "video-QA";
  t.videos = videos;
  t.arrivals_per_step = rate;
  std::mt19937 rng(2035);
  std::vector<double> weights;
  for (std::int32_t v = 0; v < videos; ++v) weights.push_back(1.0 / std::pow(v + 1.0, zipf_s));
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  std::exponential_distribution<double> gap(rate);
  std::uniform_int_distribution<int> question(10, 40);
  std::uniform_int_distribution<int> max_new(32, 512);
  std::vector<std::int32_t> asked(static_cast<std::size_t>(videos), 0);
  double clock = 0.0;
  for (std::int32_t i = 0; i < videos * questions; ++i) {
    clock += gap(rng);
    Arrival a;
    a.step = static_cast<std::int64_t>(clock);
    a.video = pick(rng);
    a.question = asked[static_cast<std::size_t>(a.video)]++;
    a.text = question(rng);
    a.max_new = max_new(rng);
    a.seed = static_cast<std::uint32_t>(rng());
    t.arrivals.push_back(a);
  }
  const auto asked_once = std::count_if(asked.begin(), asked.end(), [](std::int32_t n) { return n > 0; });
  t.config = {{"videos", videos},
              {"videos_asked", asked_once},
              {"questions_per_video_mean", questions},
              {"requests", videos * questions},
              {"zipf_s", zipf_s},
              {"arrivals_per_step", rate},
              {"system_tokens", kSystemVideo},
              {"visual_tokens", kVisual},
              {"question_tokens", "10-40"},
              {"max_new_tokens", "32-512"}};
  return t;
}

Trace text_trace(std::int32_t requests, double rate) {
  Trace t;
  t.name = "shared system prompt";
  t.arrivals_per_step = rate;
  std::mt19937 rng(3035);
  std::exponential_distribution<double> gap(rate);
  std::uniform_int_distribution<int> user(50, 500);
  std::uniform_int_distribution<int> max_new(32, 512);
  double clock = 0.0;
  for (std::int32_t i = 0; i < requests; ++i) {
    clock += gap(rng);
    Arrival a;
    a.step = static_cast<std::int64_t>(clock);
    a.text = user(rng);
    a.max_new = max_new(rng);
    a.seed = static_cast<std::uint32_t>(rng());
    t.arrivals.push_back(a);
  }
  t.config = {{"requests", requests},
              {"arrivals_per_step", rate},
              {"system_tokens", kSystemText},
              {"user_tokens", "50-500"},
              {"max_new_tokens", "32-512"}};
  return t;
}

// Text token ids fall below the vocabulary size (152k); visual keys carry
// the top bit, so the two never meet.
TokenKey visual_key(std::int32_t video, std::int32_t row) {
  return mix64((std::uint64_t(video) << 32) | std::uint32_t(row)) | (1ull << 63);
}

// The WindowQuant plan of question `q` about `video`: per window a score
// rho * (the window's own term, fixed per video) + sqrt(1 - rho^2) * (the
// question's term), standard normal either way; per layer FP16 above the
// 90th percentile, INT2 below the 60th (about 10% / 30% / 60%), thresholds
// shifted a little per layer (layer sensitivity); window 0 FP16.
PrecisionPlan window_quant_plan(std::int32_t video, std::int32_t q, std::int32_t windows, double rho) {
  PrecisionPlan plan(kLayers, windows, Precision::FP16);
  std::mt19937 own(static_cast<std::uint32_t>(mix64(0x5eedull + std::uint64_t(video))));
  std::mt19937 asked(static_cast<std::uint32_t>(mix64((std::uint64_t(video) << 20) + std::uint64_t(q) + 1)));
  // One distribution per engine: a normal distribution keeps the second
  // value of each pair it draws.
  std::normal_distribution<double> normal_own(0.0, 1.0), normal_asked(0.0, 1.0);
  const double other = std::sqrt(std::max(0.0, 1.0 - rho * rho));
  std::vector<double> scores(static_cast<std::size_t>(windows));
  for (std::int32_t w = 0; w < windows; ++w) {
    const double a = normal_own(own);
    const double b = normal_asked(asked);
    scores[static_cast<std::size_t>(w)] = rho * a + other * b;
    plan.set_score(w, static_cast<float>(scores[static_cast<std::size_t>(w)]));
  }
  constexpr double kHigh = 1.2816;  // N(0,1) 90th percentile
  constexpr double kLow = 0.2533;   // 60th
  for (std::int32_t l = 0; l < kLayers; ++l) {
    const double shift = 0.15 * ((l % 5) - 2);
    for (std::int32_t w = 1; w < windows; ++w) {
      const double s = scores[static_cast<std::size_t>(w)] + shift;
      plan.set(l, w, s > kHigh ? Precision::FP16 : (s < kLow ? Precision::INT2 : Precision::INT4));
    }
  }
  return plan;
}

Request make_request(RequestId id, const Arrival& a, const Variant& v) {
  Request r;
  r.id = id;
  r.max_new_tokens = a.max_new;
  r.arrival_time = static_cast<double>(a.step);
  std::mt19937 rng(a.seed);
  std::uniform_int_distribution<int> vocab(0, 151935);
  if (a.video < 0) {
    r.layout = TokenLayout({{TokenKind::Text, kSystemText + a.text}});
    if (v.prefix) {
      for (std::int32_t i = 0; i < kSystemText; ++i) r.token_keys.push_back(TokenKey(1000 + i));
      for (std::int32_t i = 0; i < a.text; ++i) r.token_keys.push_back(TokenKey(vocab(rng)));
    }
    return r;  // no plan: stored FP16
  }
  r.layout = TokenLayout({{TokenKind::Text, kSystemVideo}, {TokenKind::Visual, kVisual}, {TokenKind::Text, a.text}});
  const std::int32_t windows = r.layout.num_windows(kBlock);
  r.plan = v.plans == PlanKind::FP16 ? PrecisionPlan(kLayers, windows, Precision::FP16)
                                     : window_quant_plan(a.video, a.question, windows, v.rho);
  if (v.prefix) {
    r.token_keys.reserve(static_cast<std::size_t>(r.layout.num_tokens()));
    for (std::int32_t i = 0; i < kSystemVideo; ++i) r.token_keys.push_back(TokenKey(1000 + i));
    for (std::int32_t i = 0; i < kVisual; ++i) r.token_keys.push_back(visual_key(a.video, i));
    for (std::int32_t i = 0; i < a.text; ++i) r.token_keys.push_back(TokenKey(vocab(rng)));
  }
  return r;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto k = static_cast<std::size_t>(std::ceil(p * static_cast<double>(v.size()))) - 1;
  return v[std::min(k, v.size() - 1)];
}

// Causal attention FLOPs of prompt rows [start, end): row r reads r + 1 keys.
double attention_flops(std::int64_t start, std::int64_t end) {
  const double keys = 0.5 * static_cast<double>(end - start) * static_cast<double>(start + end + 1);
  return 4.0 * kLayers * kQueryHidden * keys;
}

struct Probe {
  std::int64_t step = 0;
  std::int32_t videos_held = 0;
  double cached_gib = 0.0;
};

struct Result {
  json::object summary;
  std::vector<Probe> probes;
};

Result run(const Trace& trace, const Variant& v, std::int64_t probe_every) {
  CacheConfig cc;
  cc.shape = CacheShape{kLayers, kKvHeads, kHeadDim, kBlock};
  cc.arena_bytes = kArenaBytes;
  cc.fp16_windows_first = true;
  cc.prefix_cache.enabled = v.prefix;
  cc.prefix_cache.share_higher = v.share_higher;
  if (v.content) cc.prefix_cache.identity = PrefixIdentity::Content;
  KVCacheManager cache(cc);
  SchedulerConfig sc;
  sc.max_num_seqs = 1024;
  sc.max_num_batched_tokens = 32768;
  sc.watermark = 0.0;
  sc.build_metadata = false;
  sc.build_mappings = false;
  sc.per_layer_slots = false;
  sc.demote_under_pressure = v.demote;
  if (v.content) sc.prefill_mode = PrefillMode::Exact;
  Scheduler sched(cache, sc);

  std::array<double, kNumPrecisions> block_bytes{};
  for (const Precision p : kAllPrecisions)
    block_bytes[pool_index(p)] = static_cast<double>(cache.format(p).block_bytes());
  auto gib = [&](const BlockCounts& c) {
    double b = 0.0;
    for (const Precision p : kAllPrecisions) b += static_cast<double>(c[pool_index(p)]) * block_bytes[pool_index(p)];
    return b / double(1u << 30);
  };

  const auto& work = trace.arrivals;
  std::vector<std::int64_t> first_token(work.size(), -1);
  std::vector<double> step_ms;  // modelled time of each step
  std::int64_t requested = 0;   // prompt rows of the trace
  for (const Arrival& a : work) requested += (a.video < 0 ? kSystemText : kSystemVideo + kVisual) + a.text;

  // Videos held: a video is held when one of the questions already asked
  // about it, asked again, would take every window from the cache.
  std::vector<std::vector<std::size_t>> asked(static_cast<std::size_t>(std::max(trace.videos, 0)));
  const std::int32_t video_rows = kSystemVideo + (kVisual / kBlock) * kBlock;
  double probe_s = 0.0;
  auto probe = [&](std::int64_t step) {
    const auto p0 = std::chrono::steady_clock::now();
    struct Clock {
      double& total;
      std::chrono::steady_clock::time_point start;
      ~Clock() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
    } clock{probe_s, p0};
    Probe pr;
    pr.step = step;
    pr.cached_gib = gib(cache.prefix_stats().cached);
    if (!v.prefix) return pr;
    for (const auto& list : asked) {
      for (auto it = list.rbegin(); it != list.rend(); ++it) {
        const Request r = make_request(0, work[*it], v);
        // By content the prompt is stored FP16 and takes copies for its plan.
        PrecisionPlan stored = *r.plan;
        for (std::int32_t l = 0; v.content && l < stored.num_layers(); ++l) {
          for (std::int32_t w = 1; w < stored.num_windows(); ++w) stored.set(l, w, Precision::FP16);
        }
        if (cache.match_prefix(r.layout, stored, r.token_keys, *r.plan).rows >= video_rows) {
          ++pr.videos_held;
          break;
        }
      }
    }
    return pr;
  };

  Result res;
  std::size_t next = 0;
  std::int64_t step = 0;
  std::int64_t output_tokens = 0;
  double running_sum = 0.0;
  std::int32_t peak = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (next < work.size() || sched.has_unfinished()) {
    while (next < work.size() && work[next].step <= step) {
      sched.add_request(make_request(static_cast<RequestId>(next), work[next], v));
      if (work[next].video >= 0) asked[static_cast<std::size_t>(work[next].video)].push_back(next);
      ++next;
    }
    const StepOutput out = sched.step();
    double flops = 0.0;
    double bytes = 0.0;
    for (const PrefillChunk& c : out.prefills) {
      flops += 2.0 * kParams * (c.end - c.start) + attention_flops(c.start, c.end);
      if (c.last && first_token[static_cast<std::size_t>(c.id)] < 0) first_token[static_cast<std::size_t>(c.id)] = step;
    }
    for (const RequestId id : out.decodes) {
      if (!cache.contains(id)) continue;
      const BlockCounts held = cache.blocks_held(id);
      for (const Precision p : kAllPrecisions)
        bytes += static_cast<double>(held[pool_index(p)]) * block_bytes[pool_index(p)];
      flops += 2.0 * kParams + 4.0 * kLayers * kQueryHidden * cache.num_tokens(id);
    }
    const bool busy = !out.prefills.empty() || !out.decodes.empty();
    step_ms.push_back(busy ? 1e3 * std::max(flops / kFlops, (bytes + kWeightBytes) / kBandwidth) : 0.0);
    for (const FinishedRequest& f : out.finished) output_tokens += f.generated;
    const SchedulerStats st = sched.stats();
    peak = std::max(peak, st.running + st.prefilling);
    running_sum += st.running + st.prefilling;
    if (probe_every > 0 && step % probe_every == 0 && trace.videos > 0) res.probes.push_back(probe(step));
    ++step;
  }
  const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Probe last = trace.videos > 0 ? probe(step) : Probe{step, 0, gib(cache.prefix_stats().cached)};
  res.probes.push_back(last);

  // TTFT: steps from the arrival's step to the one whose prefill sampled
  // the first token, both counted; in modelled time, those steps' sum.
  std::vector<double> ttft_steps, ttft_ms;
  std::vector<double> prefix_ms(step_ms.size() + 1, 0.0);
  for (std::size_t i = 0; i < step_ms.size(); ++i) prefix_ms[i + 1] = prefix_ms[i] + step_ms[i];
  for (std::size_t i = 0; i < work.size(); ++i) {
    if (first_token[i] < 0) continue;
    ttft_steps.push_back(static_cast<double>(first_token[i] - work[i].step + 1));
    ttft_ms.push_back(prefix_ms[static_cast<std::size_t>(first_token[i]) + 1] -
                      prefix_ms[static_cast<std::size_t>(work[i].step)]);
  }
  const SchedulerStats st = sched.stats();
  const PrefixCacheStats ps = cache.prefix_stats();
  const double total_s = prefix_ms.back() / 1e3;
  const double processed = static_cast<double>(st.prefill_tokens + st.cached_prompt_tokens);
  double held_sum = 0.0, gib_sum = 0.0;
  for (const Probe& p : res.probes) {
    held_sum += p.videos_held;
    gib_sum += p.cached_gib;
  }
  const double n_probes = static_cast<double>(res.probes.size());
  auto per_gib = [](double held, double g) { return g > 0.0 ? held / g : 0.0; };

  json::object& s = res.summary;
  s["variant"] = v.name;
  s["plans"] = v.plans == PlanKind::FP16 ? "FP16" : "WindowQuant";
  s["prefix_cache"] = v.prefix;
  s["share_higher"] = v.share_higher;
  s["identity"] = v.content ? "content" : "precision";
  s["rho"] = v.rho;
  s["demote_under_pressure"] = v.demote;
  s["steps"] = step;
  s["prefill_tokens_requested"] = requested;
  s["prefill_tokens_computed"] = st.prefill_tokens;
  s["prefill_tokens_cached"] = st.cached_prompt_tokens;
  s["served_from_cache"] = processed > 0.0 ? static_cast<double>(st.cached_prompt_tokens) / processed : 0.0;
  s["prefix_hits"] = st.prefix_hits;
  s["ttft_steps_p50"] = percentile(ttft_steps, 0.5);
  s["ttft_steps_p99"] = percentile(ttft_steps, 0.99);
  s["ttft_ms_p50"] = percentile(ttft_ms, 0.5);
  s["ttft_ms_p99"] = percentile(ttft_ms, 0.99);
  s["videos_held_end"] = last.videos_held;
  s["cached_gib_end"] = last.cached_gib;
  s["videos_per_gib_end"] = per_gib(last.videos_held, last.cached_gib);
  s["videos_held_mean"] = held_sum / n_probes;
  s["cached_gib_mean"] = gib_sum / n_probes;
  s["videos_per_gib_mean"] = per_gib(held_sum, gib_sum);
  s["decode_tokens_per_step"] =
      static_cast<double>(st.decode_tokens) / static_cast<double>(std::max<std::int64_t>(step, 1));
  s["output_tokens"] = output_tokens;
  s["modelled_seconds"] = total_s;
  s["output_tokens_per_s"] = total_s > 0.0 ? static_cast<double>(output_tokens) / total_s : 0.0;
  s["mean_concurrent"] = running_sum / static_cast<double>(std::max<std::int64_t>(step, 1));
  s["peak_concurrent"] = peak;
  s["preemptions"] = st.preempted_recompute + st.preempted_swap;
  s["demotions"] = st.demotions;
  s["finished"] = st.finished;
  s["rejected"] = st.rejected;
  s["published_blocks"] = st.published_blocks;
  s["evicted_blocks"] = ps.evicted[0] + ps.evicted[1] + ps.evicted[2];
  s["host_seconds"] = host_s;
  s["probe_seconds"] = probe_s;
  json::array series;
  for (const Probe& p : res.probes) series.push_back(json::array{p.step, p.videos_held, p.cached_gib});
  s["probes_step_videos_gib"] = std::move(series);
  return res;
}

void print_row(const Trace& t, const json::object& s, bool videos) {
  auto d = [&](const char* k) { return s.at(k).to_number<double>(); };
  std::printf("%-20s %-34s %12.0f %12.0f %6.1f%% %7.0f %7.0f %8.0f %8.0f", t.name.c_str(),
              s.at("variant").as_string().c_str(), d("prefill_tokens_requested"), d("prefill_tokens_computed"),
              100.0 * d("served_from_cache"), d("ttft_steps_p50"), d("ttft_steps_p99"), d("ttft_ms_p50"),
              d("ttft_ms_p99"));
  if (videos && s.at("prefix_cache").as_bool()) {
    std::printf(" %4.0f/%6.1f %6.2f %6.2f", d("videos_held_end"), d("cached_gib_end"), d("videos_per_gib_end"),
                d("videos_per_gib_mean"));
  } else {
    std::printf(" %11s %6s %6s", "-", "-", "-");
  }
  std::printf(" %8.1f %8.0f %6.0f %6.0f %6.1fs\n", d("decode_tokens_per_step"), d("output_tokens_per_s"),
              d("preemptions"), d("demotions"), d("host_seconds"));
  std::fflush(stdout);
}

void print_header() {
  std::printf("%-20s %-34s %12s %12s %7s %7s %7s %8s %8s %11s %6s %6s %8s %8s %6s %6s %7s\n", "trace", "variant",
              "prefill req", "computed", "cached", "TTFTp50", "TTFTp99", "ms p50", "ms p99", "held/GiB", "v/GiB", "avg",
              "dec/step", "tok/s", "preem", "demot", "host");
}

}  // namespace
}  // namespace mixkv

int main(int argc, char** argv) {
  using namespace mixkv;
  bool quick = false;
  bool sweep = false;
  double rho = 0.0;
  std::string out_path = "benchmarks/results/prefix_sim.json";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--sweep")) {
      sweep = true;
    } else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--rho") && i + 1 < argc) {
      rho = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--out PATH] [--rho R] [--sweep]\n", argv[0]);
      return 2;
    }
  }
  if (rho < 0.0 || rho > 1.0) {
    std::fprintf(stderr, "--rho %g: expected 0 <= R <= 1\n", rho);
    return 2;
  }
  const Trace video = quick ? video_trace(10, 4, 1.0, 1.0) : video_trace(50, 10, 1.0, 1.0);
  const Trace text = quick ? text_trace(200, 4.0) : text_trace(2000, 8.0);
  const std::int64_t probe_every = quick ? 50 : 250;

  const std::vector<Variant> video_variants = {
      {"FP16, no prefix cache", PlanKind::FP16, false, true, rho, false},
      {"FP16, prefix cache (vLLM-like)", PlanKind::FP16, true, true, rho, false},
      {"WindowQuant, no prefix cache", PlanKind::WindowQuant, false, true, rho, true},
      {"WindowQuant, prefix, share_higher", PlanKind::WindowQuant, true, true, rho, true},
      {"WindowQuant, prefix, exact only", PlanKind::WindowQuant, true, false, rho, true},
      {"WindowQuant, prefix by content", PlanKind::WindowQuant, true, true, rho, true, true},
  };
  const std::vector<Variant> text_variants = {
      {"no prefix cache", PlanKind::FP16, false, true, 0.0, false},
      {"prefix cache", PlanKind::FP16, true, true, 0.0, false},
  };

  json::object doc;
  doc["arena_gb"] = 126;
  doc["shape"] = {{"model", "Qwen2-7B"},
                  {"layers", kLayers},
                  {"kv_heads", kKvHeads},
                  {"head_dim", kHeadDim},
                  {"block_size", kBlock}};
  doc["scheduler"] = {{"max_num_seqs", 1024},
                      {"max_num_batched_tokens", 32768},
                      {"watermark", 0.0},
                      {"policy", "FCFS"},
                      {"preemption", "recompute"}};
  doc["step_model"] = {{"params", kParams},
                       {"weight_bytes", kWeightBytes},
                       {"flops_per_s", kFlops},
                       {"bytes_per_s", kBandwidth},
                       {"rule", "max(compute, memory) per step"}};
  doc["quick"] = quick;
  doc["rho"] = rho;
  json::array traces;
  print_header();
  for (const auto& [trace, variants] : {std::pair{&video, &video_variants}, std::pair{&text, &text_variants}}) {
    json::object t;
    t["name"] = trace->name;
    t["config"] = trace->config;
    json::array runs;
    for (const Variant& v : *variants) {
      Result r = run(*trace, v, trace->videos > 0 ? probe_every : 0);
      print_row(*trace, r.summary, trace->videos > 0);
      runs.push_back(std::move(r.summary));
    }
    t["runs"] = std::move(runs);
    traces.push_back(std::move(t));
  }
  doc["traces"] = std::move(traces);
  if (sweep) {
    // Hit rate and density against how much two questions' plans agree.
    json::array points;
    for (const double r : {0.5, 0.9, 0.99, 1.0}) {
      for (const bool higher : {true, false}) {
        const Variant v{
            "WindowQuant, prefix, rho " + std::to_string(r).substr(0, 4) + (higher ? ", share_higher" : ", exact only"),
            PlanKind::WindowQuant,
            true,
            higher,
            r,
            true};
        Result res = run(video, v, probe_every);
        print_row(video, res.summary, true);
        res.summary.erase("probes_step_videos_gib");
        points.push_back(std::move(res.summary));
      }
    }
    doc["rho_sweep"] = std::move(points);
  }
  std::ofstream f(out_path);
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  f << json::serialize(doc) << "\n";
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
