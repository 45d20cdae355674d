// libFuzzer target: sequences of Scheduler calls (docs/reliability.md).
//
// The first bytes choose a small cache (1-2 layers, block_size 16, 2-16
// slabs of 4 FP16 blocks, a host swap pool of 0-16 slots per pool, either
// FP16 packing) and a scheduler configuration (1-6 sequences, a token budget
// from the smallest allowed up, chunked prefill or not, FCFS or priority,
// watermark, demotion, swap or recompute, look-ahead, metadata, sometimes a
// planner; sometimes a malformed field), the rest up to 200 calls, valid
// and invalid, with request ids from a small range: add_request (plans,
// embeddings, both, neither, bad shapes), step, fork, finish, cancel,
// status, contains, stats, layer_metadata.
//
// Every step's output is applied to a shadow of the KV memory in the order
// step_output.h gives (demotions, swap out, swap in, copy-on-write, prefill
// chunks, decode appends), with each token's tag a function of (request,
// position), so a request recomputed after preemption writes the same tags
// again; a forked child has its parent's tags below the fork point. Checked after every call:
// Scheduler::check_invariants() (the manager's and the scheduler's); the call returned or threw a typed error, and a
// throwing or const call left describe_state() unchanged; cancel and finish are idempotent; a request is reported
// (finished or rejected) at most once per add_request; every Running request's blocks hold exactly its tokens. At the
// end the scheduler must drain without help (no request starves or thrashes forever), and then every block and host
// slot is free.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_support.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv::fuzz {
namespace {

constexpr int kMaxCalls = 200;
constexpr RequestId kMaxId = 12;
constexpr int kDrainSteps = 20000;
constexpr std::int32_t kBlock = 16;
constexpr std::int32_t kHidden = 8;

CacheConfig decode_cache(FuzzedDataProvider& in) {
  CacheConfig c;
  c.shape = CacheShape{in.ConsumeIntegralInRange<std::int32_t>(1, 2), 1, 16, kBlock};  // FP16 block 1 KiB
  c.slab_bytes = 4096;  // 4 FP16, 10 INT4 or 16 INT2 blocks
  c.arena_bytes = c.slab_bytes * in.ConsumeIntegralInRange<std::size_t>(2, 16);
  for (std::int64_t& slots : c.swap_blocks) slots = in.ConsumeIntegralInRange<std::int64_t>(0, 16);
  c.fp16_windows_first = in.ConsumeBool();
  return c;
}

SchedulerConfig decode_scheduler(FuzzedDataProvider& in, std::int32_t layers) {
  SchedulerConfig c;
  c.max_num_seqs = in.ConsumeIntegralInRange<std::int32_t>(1, 6);
  c.max_num_batched_tokens = std::max(c.max_num_seqs, kBlock) + in.ConsumeIntegralInRange<std::int32_t>(0, 80);
  c.chunked_prefill = in.ConsumeBool();
  c.policy = in.ConsumeBool() ? SchedulingPolicy::Priority : SchedulingPolicy::FCFS;
  const double watermarks[] = {0.0, 0.01, 0.1, 0.3};
  c.watermark = watermarks[in.ConsumeIntegralInRange<int>(0, 3)];
  c.demote_under_pressure = in.ConsumeBool();
  c.max_demotions_per_step = in.ConsumeIntegralInRange<std::int32_t>(0, 8);
  c.preemption = in.ConsumeBool() ? PreemptionMode::Swap : PreemptionMode::Recompute;
  c.lookahead = in.ConsumeIntegralInRange<std::int32_t>(0, 4);
  c.max_head_bypass = in.ConsumeIntegralInRange<std::int32_t>(0, 6);
  c.build_metadata = in.ConsumeBool();
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
    PlannerConfig planner;
    planner.window_size = kBlock;
    planner.sensitivities.assign(static_cast<std::size_t>(layers), 0.5);
    c.planner = planner;
  }
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    // Malformed on purpose: the constructor throws a typed error or the
    // scheduler works.
    switch (in.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: c.max_num_seqs = in.ConsumeIntegralInRange<std::int32_t>(-2, 2); break;
      case 1: c.max_num_batched_tokens = in.ConsumeIntegralInRange<std::int32_t>(-1, 20); break;
      case 2: c.watermark = in.ConsumeBool() ? std::nan("") : in.ConsumeIntegralInRange<int>(-2, 2) * 0.75; break;
      case 3: c.max_demotions_per_step = in.ConsumeIntegralInRange<std::int32_t>(-2, 0); break;
      case 4: c.lookahead = in.ConsumeIntegralInRange<std::int32_t>(-2, 0); break;
      default: {
        PlannerConfig planner;
        planner.window_size = in.ConsumeIntegralInRange<std::int32_t>(-1, 40);
        planner.sensitivities.assign(in.ConsumeIntegralInRange<std::size_t>(0, 3), in.ConsumeBool() ? 2.0 : 0.5);
        c.planner = planner;
        break;
      }
    }
  }
  return c;
}

class Harness {
 public:
  Harness(FuzzedDataProvider& in, KVCacheManager& cache, Scheduler& sched)
      : in_(in), cache_(cache), sched_(sched), shadow_(cache), layers_(cache.config().shape.num_layers) {}

  void run() {
    for (int call = 0; call < kMaxCalls && in_.remaining_bytes() > 0; ++call) {
      const std::string before = sched_.describe_state();
      bool unchanged = false;
      switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
        case 0:
        case 1:
        case 2: unchanged = !add(); break;
        case 3:
        case 4:
        case 5: step(); break;
        case 6: unchanged = !end_request(/*cancel=*/true); break;
        case 7: unchanged = !end_request(/*cancel=*/false); break;
        case 8: unchanged = !fork(); break;
        default:
          inspect();
          unchanged = true;
          break;
      }
      check(before, unchanged);
    }
    drain();
  }

 private:
  RequestId any_id() { return in_.ConsumeIntegralInRange<RequestId>(-1, kMaxId); }
  // The tag of a request's token: the same for a recompute of that position.
  Tag token(RequestId id, std::int64_t position) const { return token(id, generation_.at(id), position); }
  Tag token(RequestId id, Tag generation, std::int64_t position) const {
    const auto it = lineage_.find({id, generation});
    if (it != lineage_.end() && position < it->second.tokens) {
      return token(it->second.parent, it->second.parent_generation, position);
    }
    return mix(static_cast<Tag>(id + 2) * 0x9E3779B97F4A7C15ULL ^ generation * 0xBF58476D1CE4E5B9ULL ^
               static_cast<Tag>(position) * 0x94D049BB133111EBULL);
  }

  TokenLayout random_layout() {
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) return TokenLayout();
    std::vector<Segment> segments;
    if (in_.ConsumeIntegralInRange<int>(0, 3) > 0) {
      segments.push_back({TokenKind::Text, in_.ConsumeIntegralInRange<std::int32_t>(1, 20)});
    }
    const int dice = in_.ConsumeIntegralInRange<int>(0, 19);
    const std::int32_t visual = dice == 0  ? in_.ConsumeIntegralInRange<std::int32_t>(300, 900)  // never fits
                                : dice < 4 ? in_.ConsumeIntegralInRange<std::int32_t>(60, 200)
                                           : in_.ConsumeIntegralInRange<std::int32_t>(0, 60);
    if (visual > 0) segments.push_back({TokenKind::Visual, visual});
    if (segments.empty() || in_.ConsumeBool()) {
      segments.push_back({TokenKind::Text, in_.ConsumeIntegralInRange<std::int32_t>(1, 12)});
    }
    return TokenLayout(std::move(segments));
  }

  bool add() {
    Request r;
    r.id = any_id();
    r.layout = random_layout();
    r.max_new_tokens = in_.ConsumeIntegralInRange<std::int32_t>(-1, 40);
    r.priority = in_.ConsumeIntegralInRange<std::int32_t>(0, 3);
    clock_ += in_.ConsumeIntegralInRange<int>(0, 2);
    r.arrival_time = in_.ConsumeIntegralInRange<int>(0, 63) == 0 ? std::nan("") : clock_;
    const int source = in_.ConsumeIntegralInRange<int>(0, 15);  // 0-11 plan, 12-13 embeddings, 14 both, 15 neither
    std::vector<float> embeddings;
    if (source < 12 || source == 14) {
      std::int32_t windows = r.layout.num_windows(kBlock);
      std::int32_t layers = layers_;
      if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) {
        windows = in_.ConsumeIntegralInRange<std::int32_t>(0, windows + 2);
        layers = in_.ConsumeIntegralInRange<std::int32_t>(1, 3);
      }
      PrecisionPlan plan(layers, windows);
      for (std::int32_t w = 0; w < windows; ++w) {
        plan.set_score(w, static_cast<float>(in_.ConsumeIntegralInRange<int>(0, 1000)) / 1000.0f);
        for (std::int32_t l = 0; l < layers; ++l) {
          plan.set(l, w, static_cast<Precision>(in_.ConsumeIntegralInRange<int>(0, 2)));
        }
      }
      r.plan = std::move(plan);
    }
    if (source >= 12 && source <= 14) {
      embeddings.resize(static_cast<std::size_t>(r.layout.num_tokens()) * kHidden);
      const bool nan = in_.ConsumeIntegralInRange<int>(0, 15) == 0;
      for (float& v : embeddings) v = static_cast<float>(in_.ConsumeIntegralInRange<int>(-8, 8)) / 4.0f;
      if (nan && !embeddings.empty())
        embeddings[in_.ConsumeIntegralInRange<std::size_t>(0, embeddings.size() - 1)] = NAN;
      r.embeddings = EmbeddingsView{embeddings.data(), ElementType::F32, r.layout.num_tokens(), kHidden};
    }
    if (tracing) {
      std::string text = "add_request id " + std::to_string(r.id) + " max_new_tokens " +
                         std::to_string(r.max_new_tokens) + " priority " + std::to_string(r.priority) + " layout";
      for (const Segment& seg : r.layout.segments()) {
        text += (seg.kind == TokenKind::Text ? " T" : " V") + std::to_string(seg.length);
      }
      if (r.plan) {
        text += " plan";
        for (std::int32_t l = 0; l < r.plan->num_layers(); ++l) {
          text += ' ';
          for (std::int32_t w = 0; w < r.plan->num_windows(); ++w) text += "F42"[pool_index(r.plan->at(l, w))];
        }
      }
      std::fprintf(stderr, "%s%s\n", text.c_str(), r.embeddings ? " (embeddings)" : "");
    }
    if (attempt("add_request", [&] { sched_.add_request(r); }) != Outcome::Ok) return false;
    ++generation_[r.id];
    ++adds_[r.id];
    return true;
  }

  void step() {
    StepOutput out;
    attempt("step", [&] { out = sched_.step(); });  // a step never fails: a typed error here changes nothing
    ++steps_;
    apply(out);
  }

  // The engine's part of a step (step_output.h), on the shadow.
  void apply(const StepOutput& out) {
    const std::int32_t bs = kBlock;
    shadow_.demote(out.demotions);
    shadow_.swap(out.swap_out, /*to_host=*/true);
    shadow_.swap(out.swap_in, /*to_host=*/false);
    for (const BlockCopy& c : out.append.copies) shadow_.copy_fp16_block(c.src, c.dst);
    for (const PrefillChunk& chunk : out.prefills) {
      if (chunk.mappings.size() != static_cast<std::size_t>(layers_)) finding("prefill chunk: one mapping per layer");
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        const StoreMapping& m = chunk.mappings[static_cast<std::size_t>(layer)];
        if (static_cast<std::int32_t>(m.fp16_slots.size()) != chunk.end - chunk.start) {
          finding("prefill chunk: mapping rows != end - start");
        }
        for (std::size_t row = 0; row < m.fp16_slots.size(); ++row) {
          if (m.fp16_slots[row] >= 0) {
            shadow_.fp16_slot(m.fp16_slots[row]) =
                layer_tag(token(chunk.id, chunk.start + static_cast<std::int64_t>(row)), layer);
          }
        }
        for (const Precision p : {Precision::INT4, Precision::INT2}) {
          for (const WindowSlot& w : p == Precision::INT4 ? m.int4_windows : m.int2_windows) {
            if (w.first_row < 0 || w.first_row + bs > chunk.end - chunk.start) {
              finding("prefill chunk: a quantized window crosses the chunk's end");
            }
            shadow_.quantized(p, w.block_id) = window_tag(layer_tag(token(chunk.id, chunk.start + w.first_row), layer));
          }
        }
      }
    }
    if (out.decodes.size() > static_cast<std::size_t>(sched_.config().max_num_seqs)) finding("decode batch too large");
    if (out.num_batched_tokens > sched_.config().max_num_batched_tokens) finding("token budget exceeded");
    for (std::size_t i = 0; i < out.decodes.size(); ++i) {
      const RequestId id = out.decodes[i];
      const std::int64_t position = cache_.num_tokens(id) - 1;
      for (std::int32_t layer = 0; layer < layers_; ++layer) {
        shadow_.fp16_slot(out.append.slots[static_cast<std::size_t>(layer)][i]) = layer_tag(token(id, position), layer);
      }
    }
    for (const FinishedRequest& f : out.finished) report(f.id);
    for (const RejectedRequest& r : out.rejected) {
      if (r.reason.empty()) finding("a request rejected without a reason");
      report(r.id);
    }
  }

  void report(RequestId id) {
    if (++reports_[id] > adds_[id]) finding("request " + std::to_string(id) + " reported more often than added");
  }

  // A fork counts as an add of the child: reported once, its tokens below
  // the fork point its parent's.
  bool fork() {
    const RequestId parent = any_id();
    const RequestId child = any_id();
    const std::int32_t more = in_.ConsumeIntegralInRange<std::int32_t>(-2, 40);
    const std::int64_t tokens = cache_.contains(parent) ? cache_.num_tokens(parent) : 0;
    if (tracing) {
      std::fprintf(stderr, "fork parent %lld child %lld max_new_tokens %d\n", static_cast<long long>(parent),
                   static_cast<long long>(child), more);
    }
    const Outcome outcome = attempt("fork", [&] { sched_.fork(parent, child, more); });
    if (outcome == Outcome::UnknownId && sched_.contains(parent)) finding("fork: UnknownId for a live parent");
    if (outcome == Outcome::IndexOutOfRange) finding("fork threw IndexOutOfRange");
    if (outcome != Outcome::Ok) return false;
    lineage_[{child, ++generation_[child]}] = Fork{parent, generation_.at(parent), tokens};
    ++adds_[child];
    return true;
  }

  bool end_request(bool cancel) {
    const RequestId id = any_id();
    bool ended = false;
    const Outcome outcome =
        attempt(cancel ? "cancel" : "finish", [&] { ended = cancel ? sched_.cancel(id) : sched_.finish(id); });
    if (outcome == Outcome::UnknownId && adds_.contains(id))
      finding("cancel/finish: UnknownId for a request once added");
    if (outcome != Outcome::Ok && outcome != Outcome::UnknownId) finding("cancel/finish threw other than UnknownId");
    if (outcome != Outcome::Ok) return false;
    if (sched_.contains(id)) finding("request " + std::to_string(id) + " still live after cancel/finish");
    bool again = true;
    attempt("cancel (again)", [&] { again = sched_.cancel(id); });
    if (again) finding("cancel is not idempotent for request " + std::to_string(id));
    return ended;
  }

  void inspect() {
    const RequestId id = any_id();
    switch (in_.ConsumeIntegralInRange<int>(0, 4)) {
      case 0: attempt("status", [&] { (void)sched_.status(id); }); break;
      case 1: attempt("contains", [&] { (void)sched_.contains(id); }); break;
      case 2: attempt("stats", [&] { (void)sched_.stats(); }); break;
      case 3: attempt("has_unfinished", [&] { (void)sched_.has_unfinished(); }); break;
      default:
        attempt("layer_metadata",
                [&] { (void)sched_.layer_metadata(in_.ConsumeIntegralInRange<std::int32_t>(-1, layers_)); });
        break;
    }
  }

  void check(const std::string& before, bool unchanged) {
    check_consistency(sched_, before, unchanged);
    // Running requests hold all their tokens (prompt computed, decode tokens written).
    for (const SequenceId id : cache_.sequence_ids()) {
      if (!sched_.contains(id)) finding("the cache holds sequence " + std::to_string(id) + " of no live request");
      if (sched_.status(id).state != RequestState::Running) continue;
      std::vector<Tag> tokens(static_cast<std::size_t>(cache_.num_tokens(id)));
      for (std::size_t pos = 0; pos < tokens.size(); ++pos) tokens[pos] = token(id, static_cast<std::int64_t>(pos));
      shadow_.verify(id, tokens);
    }
  }

  // Without help from the engine every request finishes; then every block
  // and host slot is free again.
  void drain() {
    for (int s = 0; sched_.has_unfinished(); ++s) {
      if (s == kDrainSteps) {
        finding("the scheduler does not drain in " + std::to_string(kDrainSteps) + " steps; its state:\n" +
                sched_.describe_state());
      }
      const std::string before = sched_.describe_state();
      step();
      check(before, false);
    }
    if (!cache_.sequence_ids().empty()) finding("sequences left in the cache after draining");
    for (const Precision p : kAllPrecisions) {
      if (cache_.pool_stats(p).used_blocks != 0) finding(std::string(to_string(p)) + " blocks leaked");
    }
    if (cache_.free_swap_slots() != cache_.config().swap_blocks) finding("host swap slots leaked");
  }

  FuzzedDataProvider& in_;
  KVCacheManager& cache_;
  Scheduler& sched_;
  Shadow shadow_;
  std::int32_t layers_;
  double clock_ = 0.0;
  std::int64_t steps_ = 0;
  std::map<RequestId, Tag> generation_;  // add_request calls that succeeded, per id
  std::map<RequestId, int> adds_;
  struct Fork {
    RequestId parent;
    Tag parent_generation;
    std::int64_t tokens;  // the parent's at the fork
  };
  std::map<std::pair<RequestId, Tag>, Fork> lineage_;  // (child, its generation) -> its fork
  std::map<RequestId, int> reports_;
};

}  // namespace
}  // namespace mixkv::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::atexit(mixkv::fuzz::print_counters);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mixkv;
  using namespace mixkv::fuzz;
  ++counters.inputs;
  FuzzedDataProvider in(data, size);
  const CacheConfig cache_config = decode_cache(in);
  const SchedulerConfig sched_config = decode_scheduler(in, cache_config.shape.num_layers);
  if (tracing) {
    std::fprintf(stderr,
                 "cache: %d layers, %zu slabs of %zu bytes, swap %lld/%lld/%lld, fp16_windows_first %d\n"
                 "scheduler: max_num_seqs %d, max_num_batched_tokens %d, chunked %d, policy %d, watermark %g, "
                 "demote %d (max %d), preemption %d, lookahead %d, max_head_bypass %d, planner %d\n",
                 cache_config.shape.num_layers, cache_config.arena_bytes / cache_config.slab_bytes,
                 cache_config.slab_bytes, static_cast<long long>(cache_config.swap_blocks[0]),
                 static_cast<long long>(cache_config.swap_blocks[1]),
                 static_cast<long long>(cache_config.swap_blocks[2]), cache_config.fp16_windows_first,
                 sched_config.max_num_seqs, sched_config.max_num_batched_tokens, sched_config.chunked_prefill,
                 static_cast<int>(sched_config.policy), sched_config.watermark, sched_config.demote_under_pressure,
                 sched_config.max_demotions_per_step, static_cast<int>(sched_config.preemption), sched_config.lookahead,
                 sched_config.max_head_bypass, sched_config.planner.has_value());
  }
  KVCacheManager cache(cache_config);
  std::optional<Scheduler> sched;
  if (attempt("Scheduler(config)", [&] { sched.emplace(cache, sched_config); }) != Outcome::Ok) return 0;
  Harness(in, cache, *sched).run();
  return 0;
}
