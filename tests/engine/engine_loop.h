#pragma once
// An engine loop for the engine tests: a tiny model stand-in (K, V and q of
// every token a pure function of (request, position, layer, head, channel),
// a forked request taking its parent's values below the fork point) drives
// an Engine over a scripted, seeded workload of text-only and windowed video
// requests with chunked prefill, forks and cancels, and records every decode
// output. The same workload can drive a private scheduler whose steps are
// applied by hand with the cpu ops: the reference the Engine is held to.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "mixkv/cache/prefix_tables.h"
#include "mixkv/core/half.h"
#include "mixkv/core/hash.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"
#include "mixkv/engine/engine.h"

namespace mixkv::test {

// A half in [-1, 1) from (request, position, layer, head, channel, what).
inline Half model_value(RequestId id, std::int64_t pos, std::int32_t layer, std::int32_t head, std::int32_t channel,
                        std::int32_t what) {
  std::uint64_t k = mix64(static_cast<std::uint64_t>(id) * 0x9E3779B97F4A7C15ULL + 29);
  k = mix64(k ^ static_cast<std::uint64_t>(pos) * 0xBF58476D1CE4E5B9ULL);
  k = mix64(k ^ (static_cast<std::uint64_t>(layer) << 40) ^ (static_cast<std::uint64_t>(head) << 32) ^
            (static_cast<std::uint64_t>(channel) << 8) ^ static_cast<std::uint64_t>(what));
  return float_to_half(static_cast<float>(2.0 * static_cast<double>(k >> 11) / 9007199254740992.0 - 1.0));
}

// Decode outputs: (request, position, layer) -> out [q_heads * head_dim] and
// lse [q_heads]; `prefill` the same for prefill rows (Engine::prefill).
struct Outputs {
  using Rows =
      std::map<std::tuple<RequestId, std::int64_t, std::int32_t>, std::pair<std::vector<float>, std::vector<float>>>;
  Rows rows;
  Rows prefill;
};

// Records rows [0, n) of out ([n][q_heads * head_dim]) and lse ([n][q_heads])
// under (id(i), position(i), layer).
template <class Id, class Pos>
void record(Outputs::Rows& into, std::size_t n, Id&& id, Pos&& position, std::int32_t layer,
            const std::vector<float>& out, const std::vector<float>& lse, std::int32_t q_heads) {
  const std::size_t row = out.size() / std::max<std::size_t>(n, 1);
  const auto qh = static_cast<std::size_t>(q_heads);
  for (std::size_t i = 0; i < n; ++i) {
    into[{id(i), position(i), layer}] = {std::vector<float>(out.begin() + static_cast<std::ptrdiff_t>(i * row),
                                                            out.begin() + static_cast<std::ptrdiff_t>((i + 1) * row)),
                                         std::vector<float>(lse.begin() + static_cast<std::ptrdiff_t>(i * qh),
                                                            lse.begin() + static_cast<std::ptrdiff_t>((i + 1) * qh))};
  }
}

// What one run did, for the tests to assert that the pressure paths ran.
struct RunStats {
  std::int64_t steps = 0, demotions = 0, swaps_out = 0, swaps_in = 0, recomputes = 0, forks = 0, cancels = 0;
  std::int64_t prefill_rows = 0, decode_tokens = 0, copies = 0, drafts = 0, accepted = 0;
};

struct WorkloadOptions {
  std::uint32_t seed = 1;
  int requests = 16;
  bool mixed_plans = true;  // video windows at FP16, INT4 or INT2; false: every request all FP16
  int max_new_tokens = 10;  // each request generates 2 .. this many
  bool forks = true;        // fork a running request every 5th step
  bool cancels = true;      // cancel the newest live request every 7th step
  int max_steps = 2000;
  // Prefix caching: video requests ask one of two videos (a system text of
  // one block, three windows) with their own question and keys.
  bool shared_videos = false;
};

// The scripted workload: requests, when they arrive, and forks/cancels
// decided from the scheduler's state (identical on every run of it).
class Workload {
 public:
  Workload(const CacheShape& shape, const WorkloadOptions& o) : shape_(shape), options_(o) {
    std::mt19937 rng(o.seed);
    for (int i = 0; i < o.requests; ++i) {
      Request r;
      r.id = 100 + i;
      const bool video = i % 3 != 0;
      if (video && o.shared_videos) {
        const int which = static_cast<int>(rng() % 2);
        const int question = 2 + static_cast<int>(rng() % 6);
        r.layout = TokenLayout({{TokenKind::Text, shape.block_size},
                                {TokenKind::Visual, 3 * shape.block_size},
                                {TokenKind::Text, question}});
        for (std::int32_t k = 0; k < shape.block_size; ++k) r.token_keys.push_back(1000 + k);
        for (std::int32_t k = 0; k < 3 * shape.block_size; ++k) r.token_keys.push_back(100000 * (which + 1) + k);
        for (std::int32_t k = 0; k < question; ++k) r.token_keys.push_back(10000000 + 1000 * i + k);
      } else if (video) {
        const int windows = 1 + static_cast<int>(rng() % 4);
        const int tail = static_cast<int>(rng() % 9);
        r.layout = TokenLayout({{TokenKind::Text, 3 + static_cast<int>(rng() % 12)},
                                {TokenKind::Visual, windows * shape.block_size + tail},
                                {TokenKind::Text, 2 + static_cast<int>(rng() % 6)}});
        PrecisionPlan plan(shape.num_layers, r.layout.num_windows(shape.block_size));
        for (std::int32_t w = 0; w < plan.num_windows(); ++w) {
          plan.set_score(w, static_cast<float>(rng() % 1000) / 1000.0f);
          for (std::int32_t l = 0; l < shape.num_layers; ++l) {
            const Precision p = !o.mixed_plans || w == 0 ? Precision::FP16 : static_cast<Precision>(rng() % 3);
            plan.set(l, w, p);
          }
        }
        r.plan = plan;
      } else {
        r.layout = TokenLayout({{TokenKind::Text, 5 + static_cast<int>(rng() % 70)}});  // no plan: FP16
      }
      r.max_new_tokens = 2 + static_cast<int>(rng() % static_cast<unsigned>(o.max_new_tokens - 1));
      r.arrival_time = static_cast<double>(i);
      arrivals_.push_back({i / 3, r});
    }
  }

  // Adds what arrives at `step`, then forks or cancels, through `target`
  // (an Engine or a Scheduler: the same calls in the same order).
  template <class Target>
  void before_step(std::int64_t step, Target& target, const Scheduler& sched,
                   std::map<RequestId, std::pair<RequestId, std::int64_t>>& lineage, RunStats& stats) {
    for (const auto& [at, r] : arrivals_) {
      if (at == step) target.add_request(r);
    }
    // Every 5th step: fork the oldest running request with tokens left; every
    // 7th: cancel the newest live one.
    if (options_.forks && step % 5 == 3) {
      for (const auto& [at, r] : arrivals_) {
        if (!sched.contains(r.id)) continue;
        const RequestStatus st = sched.status(r.id);
        if (st.state != RequestState::Running || st.generated + 1 >= r.max_new_tokens) continue;
        const RequestId child = next_child_++;
        try {
          target.fork(r.id, child, 2);
          lineage[child] = {r.id, sched.cache().num_tokens(r.id)};
          ++stats.forks;
        } catch (const std::exception&) {
        }
        break;
      }
    }
    if (options_.cancels && step % 7 == 6) {
      for (auto it = arrivals_.rbegin(); it != arrivals_.rend(); ++it) {
        if (sched.contains(it->second.id)) {
          if (target.cancel(it->second.id)) ++stats.cancels;
          break;
        }
      }
    }
  }

  int max_steps() const { return options_.max_steps; }

 private:
  CacheShape shape_;
  WorkloadOptions options_;
  std::vector<std::pair<std::int64_t, Request>> arrivals_;
  RequestId next_child_ = 1000;
};

// Whose values `id` has at `pos`: its own, or an ancestor's below a fork point.
inline RequestId source_of(const std::map<RequestId, std::pair<RequestId, std::int64_t>>& lineage, RequestId id,
                           std::int64_t pos) {
  for (auto it = lineage.find(id); it != lineage.end() && pos < it->second.second; it = lineage.find(id)) {
    id = it->second.first;
  }
  return id;
}

// The model's K/V rows (what = 1, 2) or queries (what = 7) of request `id` at
// positions [from, to), appended to `out`: [rows][heads][head_dim].
inline void model_rows(const std::map<RequestId, std::pair<RequestId, std::int64_t>>& lineage, RequestId id,
                       std::int64_t from, std::int64_t to, std::int32_t layer, std::int32_t heads,
                       std::int32_t head_dim, std::int32_t what, std::vector<Half>& out) {
  for (std::int64_t pos = from; pos < to; ++pos) {
    const RequestId owner = source_of(lineage, id, pos);
    for (std::int32_t h = 0; h < heads; ++h) {
      for (std::int32_t c = 0; c < head_dim; ++c) out.push_back(model_value(owner, pos, layer, h, c, what));
    }
  }
}

// Where the loop's arrays live: host vectors (CPU backend) or device copies.
class Memory {
 public:
  virtual ~Memory() = default;
  virtual TensorView input(const std::vector<Half>& host, std::initializer_list<std::int64_t> shape) = 0;
  virtual TensorView output(DType dtype, std::initializer_list<std::int64_t> shape) = 0;
  virtual std::vector<float> read(const TensorView& t) = 0;  // F16 or F32, widened
  virtual void release() = 0;                                // after a step
};

class HostMemory : public Memory {
 public:
  TensorView input(const std::vector<Half>& host, std::initializer_list<std::int64_t> shape) override {
    halves_.push_back(host);
    return view(halves_.back().data(), DType::F16, shape);
  }
  TensorView output(DType dtype, std::initializer_list<std::int64_t> shape) override {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    words_.emplace_back(static_cast<std::size_t>(n), 0.0f);  // 4 bytes an element holds either type
    return view(words_.back().data(), dtype, shape);
  }
  std::vector<float> read(const TensorView& t) override {
    std::vector<float> r(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < r.size(); ++i) {
      r[i] = t.dtype == DType::F16 ? half_to_float(static_cast<const Half*>(t.data)[i])
                                   : static_cast<const float*>(t.data)[i];
    }
    return r;
  }
  void release() override {
    halves_.clear();
    words_.clear();
  }
  static TensorView view(void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
    TensorView t;
    t.data = data;
    t.dtype = dtype;
    t.ndim = static_cast<std::int32_t>(shape.size());
    std::size_t i = 0;
    for (const std::int64_t d : shape) t.shape[i++] = d;
    return t;
  }

 private:
  std::deque<std::vector<Half>> halves_;
  std::deque<std::vector<float>> words_;
};

// One run of `workload` on `engine`: every step's stores (or, with
// `through_cache`, prefills attending through the cache) and attends; after
// every step the scheduler's and the manager's invariants.
inline RunStats run_engine(Engine& engine, Workload workload, Memory& mem, Outputs& outputs,
                           bool through_cache = false) {
  RunStats stats;
  std::map<RequestId, std::pair<RequestId, std::int64_t>> lineage;
  const CacheShape& s = engine.config().cache.shape;
  const std::int32_t qh = engine.config().num_q_heads;
  for (std::int64_t step = 0; step < workload.max_steps(); ++step) {
    workload.before_step(step, engine, engine.scheduler(), lineage, stats);
    if (!engine.has_unfinished()) break;
    const StepOutput& out = engine.step();
    ++stats.steps;
    stats.demotions += static_cast<std::int64_t>(out.demotions.size());
    stats.swaps_out += static_cast<std::int64_t>(out.swapped_out.size());
    stats.swaps_in += static_cast<std::int64_t>(out.swapped_in.size());
    stats.recomputes += static_cast<std::int64_t>(out.preempted.size());
    stats.copies += static_cast<std::int64_t>(out.append.copies.size());
    // Decode rows: one a decode, or with drafts (step.decode_rows) the
    // sequence's last n tokens, the sampled one first.
    std::vector<std::pair<RequestId, std::int64_t>> decode_rows;
    for (std::size_t b = 0; b < out.decodes.size(); ++b) {
      const std::int64_t n = out.decode_rows.empty() ? 1 : out.decode_rows[b + 1] - out.decode_rows[b];
      const std::int64_t tokens = engine.cache().num_tokens(out.decodes[b]);
      for (std::int64_t j = 0; j < n; ++j) decode_rows.emplace_back(out.decodes[b], tokens - n + j);
    }
    const auto batch = static_cast<std::int64_t>(decode_rows.size());
    std::int64_t rows = 0;
    for (const PrefillChunk& c : out.prefills) rows += c.end - c.start;
    stats.prefill_rows += rows;
    stats.decode_tokens += batch;
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      std::vector<Half> k, v;
      for (const PrefillChunk& c : out.prefills) {
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 1, k);
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 2, v);
      }
      if (!through_cache) {
        engine.store(layer, mem.input(k, {rows, s.num_kv_heads, s.head_dim}),
                     mem.input(v, {rows, s.num_kv_heads, s.head_dim}));
      } else if (rows > 0) {
        std::vector<Half> q;
        std::vector<std::pair<RequestId, std::int64_t>> who;
        for (const PrefillChunk& c : out.prefills) {
          model_rows(lineage, c.id, c.start, c.end, layer, qh, s.head_dim, 7, q);
          for (std::int64_t p = c.start; p < c.end; ++p) who.emplace_back(c.id, p);
        }
        const TensorView o = mem.output(DType::F16, {rows, qh, s.head_dim});
        const TensorView lse = mem.output(DType::F32, {rows, qh});
        engine.prefill(layer, mem.input(q, {rows, qh, s.head_dim}), mem.input(k, {rows, s.num_kv_heads, s.head_dim}),
                       mem.input(v, {rows, s.num_kv_heads, s.head_dim}), o, &lse);
        record(
            outputs.prefill, who.size(), [&](std::size_t i) { return who[i].first; },
            [&](std::size_t i) { return who[i].second; }, layer, mem.read(o), mem.read(lse), qh);
      }
      if (batch == 0) continue;
      std::vector<Half> q, dk, dv;
      for (const auto& [id, p] : decode_rows) {
        model_rows(lineage, id, p, p + 1, layer, qh, s.head_dim, 7, q);
        model_rows(lineage, id, p, p + 1, layer, s.num_kv_heads, s.head_dim, 1, dk);
        model_rows(lineage, id, p, p + 1, layer, s.num_kv_heads, s.head_dim, 2, dv);
      }
      const TensorView o = mem.output(DType::F16, {batch, qh, s.head_dim});
      const TensorView lse = mem.output(DType::F32, {batch, qh});
      engine.attend(layer, mem.input(q, {batch, qh, s.head_dim}), mem.input(dk, {batch, s.num_kv_heads, s.head_dim}),
                    mem.input(dv, {batch, s.num_kv_heads, s.head_dim}), o, &lse);
      record(
          outputs.rows, decode_rows.size(), [&](std::size_t i) { return decode_rows[i].first; },
          [&](std::size_t i) { return decode_rows[i].second; }, layer, mem.read(o), mem.read(lse), qh);
    }
    // Drafts: a pseudo-random number of them accepted (the rest leave the
    // cache and are decoded again as later rows).
    for (std::size_t b = 0; !out.decode_rows.empty() && b < out.decodes.size(); ++b) {
      const std::int32_t drafts = out.decode_rows[b + 1] - out.decode_rows[b] - 1;
      if (drafts == 0) continue;
      const auto tokens = static_cast<std::uint64_t>(engine.cache().num_tokens(out.decodes[b]));
      const auto accepted = static_cast<std::int32_t>(mix64(static_cast<std::uint64_t>(out.decodes[b]) * 131 + tokens) %
                                                      static_cast<std::uint64_t>(drafts + 1));
      engine.accept(out.decodes[b], accepted);
      stats.drafts += drafts;
      stats.accepted += accepted;
    }
    mem.release();
    engine.scheduler().check_invariants();
  }
  return stats;
}

// What a prefill chunk's rows compute, in float64: row j of the chunk
// attends to the keys the cache holds before the chunk (page lists of
// prefix_metadata, dequantized by read_head) and to chunk rows <= j (k, v:
// [rows][kv_heads][head_dim]). out [rows][q_heads][head_dim] rounded to FP16
// as the backends write it, lse [rows][q_heads].
inline void dense_prefill(const KVCacheManager& cache, const PoolViews& pools, SequenceId id, std::int32_t start,
                          std::int32_t layer, std::int32_t q_heads, const std::vector<Half>& q,
                          const std::vector<Half>& k, const std::vector<Half>& v, std::vector<float>& out,
                          std::vector<float>& lse) {
  const CacheShape& s = cache.config().shape;
  const std::size_t d = static_cast<std::size_t>(s.head_dim);
  const std::size_t kvh = static_cast<std::size_t>(s.num_kv_heads);
  const std::size_t rows = k.size() / (kvh * d);
  const auto tables = prefix_metadata(cache, std::vector<SequenceId>{id}, std::vector<std::int32_t>{start})
                          .layers[static_cast<std::size_t>(layer)];
  // Cached keys and values per KV head: [kv_head][token][channel].
  std::vector<std::vector<float>> ck(kvh), cv(kvh);
  const std::size_t bs = static_cast<std::size_t>(s.block_size);
  std::vector<float> kb(bs * d), vb(bs * d);
  for (const Precision p : kAllPrecisions) {
    const PagedPoolTable& t = tables[pool_index(p)];
    const PoolView& pool = pools[pool_index(p)];
    for (std::int32_t j = t.indptr[0]; j < t.indptr[1]; ++j) {
      const std::size_t n = j + 1 == t.indptr[1] ? static_cast<std::size_t>(t.last_block_len[0]) : bs;
      for (std::size_t h = 0; h < kvh; ++h) {
        cpu::read_head(
            pool.format,
            pool.block(t.indices[static_cast<std::size_t>(j)]) + pool.format.head_offset(static_cast<int>(h)),
            kb.data(), vb.data());
        ck[h].insert(ck[h].end(), kb.begin(), kb.begin() + static_cast<std::ptrdiff_t>(n * d));
        cv[h].insert(cv[h].end(), vb.begin(), vb.begin() + static_cast<std::ptrdiff_t>(n * d));
      }
    }
  }
  const std::size_t qh = static_cast<std::size_t>(q_heads);
  const std::size_t group = qh / kvh;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  out.assign(rows * qh * d, 0.0f);
  lse.assign(rows * qh, 0.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t h = 0; h < qh; ++h) {
      const std::size_t g = h / group;
      const Half* qr = &q[(r * qh + h) * d];
      std::vector<double> score;
      std::vector<const float*> cached_v;
      const std::size_t cached = ck[g].size() / d;
      for (std::size_t t = 0; t < cached; ++t) {
        double dot = 0.0;
        for (std::size_t c = 0; c < d; ++c) dot += double{half_to_float(qr[c])} * ck[g][t * d + c];
        score.push_back(dot * scale);
      }
      for (std::size_t t = 0; t <= r; ++t) {
        double dot = 0.0;
        for (std::size_t c = 0; c < d; ++c)
          dot += double{half_to_float(qr[c])} * half_to_float(k[(t * kvh + g) * d + c]);
        score.push_back(dot * scale);
      }
      const double m = *std::max_element(score.begin(), score.end());
      double sum = 0.0;
      std::vector<double> acc(d, 0.0);
      for (std::size_t t = 0; t < score.size(); ++t) {
        const double w = std::exp(score[t] - m);
        sum += w;
        for (std::size_t c = 0; c < d; ++c) {
          acc[c] +=
              w * (t < cached ? double{cv[g][t * d + c]} : double{half_to_float(v[((t - cached) * kvh + g) * d + c])});
        }
      }
      for (std::size_t c = 0; c < d; ++c) {
        out[(r * qh + h) * d + c] = half_to_float(float_to_half(static_cast<float>(acc[c] / sum)));
      }
      lse[r * qh + h] = static_cast<float>(m + std::log(sum));
    }
  }
}

// The reference: the same workload on a private manager and scheduler, every
// step applied by hand with the cpu ops (demote, swap out, swap in, copies,
// store through the chunks' mappings, append at append.slots, attention over
// step.metadata), outputs rounded to FP16 as the backends write them.
// With `prefill_outputs`, every prefill row's attention through the cache
// too (dense_prefill), before its chunk is stored.
inline void run_reference(const EngineConfig& config, Workload workload, Outputs& outputs,
                          bool prefill_outputs = false) {
  KVCacheManager cache(config.cache);
  SchedulerConfig sc = config.scheduler;
  sc.build_metadata = sc.per_layer_slots = sc.build_mappings = true;
  Scheduler sched(cache, sc);
  std::vector<std::byte> arena(config.cache.arena_bytes), host(std::max<std::size_t>(cache.swap_bytes(), 1));
  const PoolViews pools = cache.arena_layout().at(arena.data());
  const PoolViews host_pools = cache.swap_layout().at(host.data());
  const CacheShape& s = config.cache.shape;
  const std::int32_t qh = config.num_q_heads;
  std::map<RequestId, std::pair<RequestId, std::int64_t>> lineage;
  RunStats stats;
  for (std::int64_t step = 0; step < workload.max_steps(); ++step) {
    workload.before_step(step, sched, sched, lineage, stats);
    if (!sched.has_unfinished()) break;
    const StepOutput out = sched.step();
    cpu::demote(out.demotions, pools);
    cpu::swap_blocks(out.swap_out, SwapDirection::DeviceToHost, pools, host_pools);
    cpu::swap_blocks(out.swap_in, SwapDirection::HostToDevice, pools, host_pools);
    cpu::copy_blocks(out.append.copies, pools[0]);
    for (const PrefillChunk& c : out.prefills) {
      for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
        std::vector<Half> k, v;
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 1, k);
        model_rows(lineage, c.id, c.start, c.end, layer, s.num_kv_heads, s.head_dim, 2, v);
        if (prefill_outputs) {
          std::vector<Half> q;
          model_rows(lineage, c.id, c.start, c.end, layer, qh, s.head_dim, 7, q);
          std::vector<float> o, l;
          dense_prefill(cache, pools, c.id, c.start, layer, qh, q, k, v, o, l);
          record(
              outputs.prefill, static_cast<std::size_t>(c.end - c.start), [&](std::size_t) { return c.id; },
              [&](std::size_t i) { return c.start + static_cast<std::int64_t>(i); }, layer, o, l, qh);
        }
        cpu::store_prefill(k, v, c.mappings[static_cast<std::size_t>(layer)], pools);
      }
    }
    const std::size_t batch = out.decodes.size();
    if (batch == 0) continue;
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      std::vector<Half> q, k, v;
      std::vector<std::int64_t> pos(batch);
      for (std::size_t b = 0; b < batch; ++b) {
        pos[b] = cache.num_tokens(out.decodes[b]) - 1;
        model_rows(lineage, out.decodes[b], pos[b], pos[b] + 1, layer, qh, s.head_dim, 7, q);
        model_rows(lineage, out.decodes[b], pos[b], pos[b] + 1, layer, s.num_kv_heads, s.head_dim, 1, k);
        model_rows(lineage, out.decodes[b], pos[b], pos[b] + 1, layer, s.num_kv_heads, s.head_dim, 2, v);
      }
      cpu::append(k, v, out.append.slots[static_cast<std::size_t>(layer)], pools[0]);
      std::vector<float> o(q.size()), lse(batch * static_cast<std::size_t>(qh));
      cpu::DecodeAttentionArgs args;
      args.q = q;
      args.num_q_heads = qh;
      args.sm_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
      args.tables = &out.metadata.layers[static_cast<std::size_t>(layer)];
      args.pools = pools;
      args.out = o;
      args.lse = lse;
      cpu::decode_attention(args);
      for (float& x : o) x = half_to_float(float_to_half(x));
      const std::size_t row = static_cast<std::size_t>(qh) * s.head_dim;
      for (std::size_t b = 0; b < batch; ++b) {
        outputs.rows[{out.decodes[b], pos[b], layer}] = {
            std::vector<float>(o.begin() + static_cast<std::ptrdiff_t>(b * row),
                               o.begin() + static_cast<std::ptrdiff_t>((b + 1) * row)),
            std::vector<float>(lse.begin() + static_cast<std::ptrdiff_t>(b * qh),
                               lse.begin() + static_cast<std::ptrdiff_t>((b + 1) * qh))};
      }
    }
  }
}

// Every pool empty, every host slot free.
inline void expect_empty(const KVCacheManager& cache) {
  for (const Precision p : kAllPrecisions) EXPECT_EQ(cache.pool_stats(p).used_blocks, 0) << to_string(p);
  EXPECT_EQ(cache.free_swap_slots(), cache.config().swap_blocks);
  EXPECT_TRUE(cache.sequence_ids().empty());
  EXPECT_NO_THROW(cache.check_invariants());
}

// Largest absolute difference of out and of lse. Every key of `a` must be in
// `b`, and the other way round unless `a_may_lack` (a recomputed request
// samples the token after its re-prefill without a decode: `a` then lacks
// that position).
struct Diff {
  double out = 0.0, lse = 0.0;
};
inline Diff compare(const Outputs::Rows& a, const Outputs::Rows& b, bool a_may_lack = false) {
  Diff d;
  if (a_may_lack) {
    EXPECT_LE(a.size(), b.size());
  } else {
    EXPECT_EQ(a.size(), b.size());
  }
  for (const auto& [key, ab] : a) {
    const auto it = b.find(key);
    if (it == b.end()) {
      ADD_FAILURE() << "request " << std::get<0>(key) << " position " << std::get<1>(key) << " layer "
                    << std::get<2>(key) << ": missing in the other run";
      continue;
    }
    for (std::size_t i = 0; i < ab.first.size(); ++i) {
      d.out = std::max(d.out, static_cast<double>(std::abs(ab.first[i] - it->second.first[i])));
    }
    for (std::size_t i = 0; i < ab.second.size(); ++i) {
      d.lse = std::max(d.lse, static_cast<double>(std::abs(ab.second[i] - it->second.second[i])));
    }
  }
  return d;
}
inline Diff compare(const Outputs& a, const Outputs& b, bool a_may_lack = false) {
  return compare(a.rows, b.rows, a_may_lack);
}

}  // namespace mixkv::test
