#include "mixkv/scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "mixkv/core/errors.h"
#include "scheduler_impl.h"

namespace mixkv {

using scheduler_detail::at;
using scheduler_detail::counts_text;
using scheduler_detail::Entry;
using scheduler_detail::Queue;

Scheduler::Impl::Impl(KVCacheManager& c, SchedulerConfig cfg, std::shared_ptr<PlanSource> source)
    : cache(c), config(std::move(cfg)), planner(std::move(source)) {
  const CacheConfig& cc = cache.config();
  num_layers = cc.shape.num_layers;
  block_size = cc.shape.block_size;
  auto bad = [](const std::string& what) { throw InvalidArgument("config." + what); };
  if (config.max_num_seqs < 1) bad("max_num_seqs = " + std::to_string(config.max_num_seqs) + ", expected >= 1");
  if (config.max_num_batched_tokens < std::max(config.max_num_seqs, block_size)) {
    bad("max_num_batched_tokens = " + std::to_string(config.max_num_batched_tokens) +
        ", expected >= max(max_num_seqs, block_size) = " + std::to_string(std::max(config.max_num_seqs, block_size)));
  }
  if (!(config.watermark >= 0.0 && config.watermark < 1.0)) {
    bad("watermark = " + std::to_string(config.watermark) + ", expected 0 <= watermark < 1");
  }
  if (config.max_demotions_per_step < 0) {
    bad("max_demotions_per_step = " + std::to_string(config.max_demotions_per_step) + ", expected >= 0");
  }
  if (config.lookahead < 0) bad("lookahead = " + std::to_string(config.lookahead) + ", expected >= 0");
  if (config.num_speculative_tokens < 0) {
    bad("num_speculative_tokens = " + std::to_string(config.num_speculative_tokens) + ", expected >= 0");
  }
  if (config.max_head_bypass < 0) {
    bad("max_head_bypass = " + std::to_string(config.max_head_bypass) + ", expected >= 0");
  }
  const auto policy = static_cast<int>(config.policy);
  if (policy < 0 || policy > 1) bad("policy = " + std::to_string(policy) + ", expected FCFS (0) or Priority (1)");
  const auto mode = static_cast<int>(config.preemption);
  if (mode < 0 || mode > 1) bad("preemption = " + std::to_string(mode) + ", expected Recompute (0) or Swap (1)");
  const auto prefill = static_cast<int>(config.prefill_mode);
  if (prefill < 0 || prefill > 1)
    bad("prefill_mode = " + std::to_string(prefill) + ", expected Compact (0) or Exact (1)");
  if (cc.prefix_cache.enabled && cc.prefix_cache.identity == PrefixIdentity::Content &&
      config.prefill_mode != PrefillMode::Exact) {
    bad("prefill_mode = Compact with the cache's prefix_cache.identity = Content, expected Exact: a block is "
        "named by its content alone only when every row is computed reading FP16 keys");
  }
  if (config.prefill_mode == PrefillMode::Exact && !cc.fp16_windows_first) {
    bad("prefill_mode = Exact needs the cache's fp16_windows_first = true (CacheConfig::fp16_windows_first): the "
        "plan's demotions after the prompt move whole FP16 blocks, one a window");
  }
  if (config.planner && planner) {
    throw InvalidArgument(
        "config.planner and planner are both given, expected at most one source of plans (config.planner builds "
        "the CPU planner; pass a PlanSource for any other)");
  }
  if (config.planner) {
    if (config.planner->window_size != block_size) {
      bad("planner.window_size = " + std::to_string(config.planner->window_size) +
          ", expected the cache's block_size " + std::to_string(block_size));
    }
    planner = make_cpu_plan_source(*config.planner);
  }
  if (planner) {
    // The same checks for any source: its plans must fit this cache, and
    // its floors bind demotion.
    const PlannerConfig& pc = planner->config();
    const std::string name = config.planner ? "config.planner" : "planner.config()";
    if (pc.window_size != block_size) {
      throw InvalidArgument(name + ".window_size = " + std::to_string(pc.window_size) +
                            ", expected the cache's block_size " + std::to_string(block_size));
    }
    if (pc.sensitivities.size() != static_cast<std::size_t>(num_layers)) {
      throw InvalidArgument(name + ".sensitivities has " + std::to_string(pc.sensitivities.size()) +
                            " layers, expected " + std::to_string(num_layers) + " (the cache's num_layers)");
    }
    if (!pc.min_precision.empty() && pc.min_precision.size() != static_cast<std::size_t>(num_layers)) {
      throw InvalidArgument(name + ".min_precision has " + std::to_string(pc.min_precision.size()) +
                            " layers, expected 0 or " + std::to_string(num_layers) + " (the cache's num_layers)");
    }
    for (std::size_t l = 0; l < pc.min_precision.size(); ++l) {
      const int p = pool_index(pc.min_precision[l]);
      if (p < 0 || p >= kNumPrecisions) {
        throw InvalidArgument(name + ".min_precision[" + std::to_string(l) + "] = " + std::to_string(p) +
                              ", expected FP16 (0), INT4 (1) or INT2 (2)");
      }
    }
    floors = pc.min_precision;
  }
  configure_ages();
  if (!cache.sequence_ids().empty()) {
    throw InvalidArgument("cache holds " + std::to_string(cache.sequence_ids().size()) +
                          " sequences, expected an empty cache for the scheduler to drive");
  }
  const auto slabs = static_cast<std::int64_t>(std::ceil(config.watermark * cache.total_slabs()));
  reserve_fp16 = slabs * cache.pool_stats(Precision::FP16).blocks_per_slab;
  fp16_limit = std::int64_t{cache.total_slabs()} * cache.pool_stats(Precision::FP16).blocks_per_slab;
  const bool demotable =
      floors.empty() || std::ranges::any_of(floors, [](Precision p) { return p != Precision::FP16; });
  if (config.demote_under_pressure && config.max_demotions_per_step > 0 && demotable) {
    demote_headroom = cache.pool_stats(Precision::FP16).blocks_per_slab;
  }
  free_slots.reserve(static_cast<std::size_t>(config.max_num_seqs));
  for (std::int32_t s = config.max_num_seqs; s-- > 0;) free_slots.push_back(s);
}

Entry& Scheduler::Impl::live(RequestId id, const char* name) {
  const auto it = entries.find(id);
  if (it == entries.end()) {
    throw UnknownId(std::string(name) + " = " + std::to_string(id) + " is not a live request of this scheduler");
  }
  return it->second;
}

// Whether `blocks` can be had now, leaving the watermark for the running
// requests' growth when there are any.
bool Scheduler::Impl::fits(const BlockCounts& blocks, bool with_reserve, const PrefixMatch* match) const {
  BlockCounts need = blocks;
  if (with_reserve && !running.empty()) need[0] += reserve_fp16;
  return match != nullptr ? cache.can_allocate(need, *match) : cache.can_allocate(need);
}

// The most `e` will ever hold under `plan`: its prompt plus max_new_tokens - 1
// decode tokens (the last sampled token is never stored), all FP16; with
// age tiers, its old windows demoted (aged_footprint).
BlockCounts Scheduler::Impl::footprint(const Entry& e, const PrecisionPlan& plan) const {
  BlockCounts most{};
  const std::int64_t more = e.max_new_tokens - 1 - (e.prompt.num_tokens() - e.original.num_tokens());
  if (!tiers.empty()) return aged_footprint(e, plan, e.prompt.num_tokens() + std::max<std::int64_t>(more, 0));
  for (std::int32_t layer = 0; layer < num_layers; ++layer) {
    const auto windows = plan.window_counts(layer);
    const std::int64_t fp16 =
        e.prompt.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * block_size + std::max<std::int64_t>(more, 0);
    most[0] += (fp16 + block_size - 1) / block_size;
    most[1] += windows[1];
    most[2] += windows[2];
  }
  return most;
}

// Slabs that `blocks` take at the least (each pool's blocks packed).
std::int64_t Scheduler::Impl::slabs_for(const BlockCounts& blocks) const {
  std::int64_t slabs = 0;
  for (const Precision p : kAllPrecisions) {
    const std::int64_t per = cache.pool_stats(p).blocks_per_slab;
    slabs += (blocks[at(p)] + per - 1) / per;
  }
  return slabs;
}

// Why `e` can never run to completion in this cache, or nullopt.
std::optional<std::string> Scheduler::Impl::never_fits(const Entry& e) const {
  if (!config.chunked_prefill && e.prompt.num_tokens() > config.max_num_batched_tokens) {
    return "its prompt of " + std::to_string(e.prompt.num_tokens()) +
           " tokens exceeds max_num_batched_tokens = " + std::to_string(config.max_num_batched_tokens) +
           " and chunked_prefill is off";
  }
  if (auto reason = fp16_never_fits(e)) return reason;
  const BlockCounts most = footprint(e, e.plan);
  const std::int64_t total = cache.total_slabs();
  if (slabs_for(most) > total) {
    return "with its " + std::to_string(e.max_new_tokens) + " new tokens it needs " + counts_text(most) + " blocks (" +
           std::to_string(slabs_for(most)) + " slabs), the whole cache holds " + std::to_string(total) + " slabs";
  }
  return std::nullopt;
}

// End of the chunk that starts at `start` with `budget` tokens: never
// inside a visual window (a quantized window is stored from all its rows at
// once), 0 when no chunk fits.
std::int32_t Scheduler::Impl::chunk_end(const Entry& e, std::int32_t budget, std::int32_t start) const {
  const std::int32_t total = e.prompt.num_tokens();
  const std::int32_t remaining = total - start;
  if (remaining <= budget) return total;
  if (!config.chunked_prefill) return 0;
  std::int32_t end = start + budget;
  const auto next = std::upper_bound(e.window_starts.begin(), e.window_starts.end(), end - 1);
  if (next != e.window_starts.begin()) {
    const std::int32_t start = *std::prev(next);
    if (start < end && end < start + block_size) end = start;
  }
  return end > start ? end : 0;
}

// Keeps `decoding` and the prefilling count in step with the states.
void Scheduler::Impl::set_state(Entry& e, RequestState state) {
  if (e.state == RequestState::Running) {
    Entry* last = decoding.back();
    decoding[static_cast<std::size_t>(e.decode_index)] = last;
    last->decode_index = e.decode_index;
    decoding.pop_back();
    e.decode_index = -1;
  }
  if (e.state == RequestState::Prefilling) --prefilling;
  e.state = state;
  if (state == RequestState::Running) {
    e.decode_index = static_cast<std::int32_t>(decoding.size());
    decoding.push_back(&e);
  }
  if (state == RequestState::Prefilling) ++prefilling;
}

void Scheduler::Impl::take_slot(Entry& e) {
  e.slot = free_slots.back();
  free_slots.pop_back();
}

void Scheduler::Impl::drop_slot(Entry& e) {
  if (e.slot >= 0) free_slots.push_back(e.slot);
  e.slot = -1;
  e.table = nullptr;
}

void Scheduler::Impl::release(Entry& e) {
  // A sequence that vanished is not the scheduler's to free: the id may name
  // another caller's sequence now.
  const bool holds =
      e.state == RequestState::Prefilling || e.state == RequestState::Running || e.state == RequestState::Swapped;
  if (holds && !vanished(e)) cache.free_sequence(e.id);
  unplan(e);
  drop_slot(e);
  if (e.next_drafts >= 0) --overrides;
  reporting[e.id] =
      RequestStatus{RequestState::Finished, e.prompt.num_tokens(), e.computed, e.generated, -1, e.preemptions, 0};
  if (e.hook.is_linked()) {
    Queue& q = e.state == RequestState::Waiting ? waiting : (e.state == RequestState::Swapped ? swapped : running);
    q.erase(q.iterator_to(e));
  }
  set_state(e, RequestState::Finished);
  retired.insert(e.id);
  entries.erase(e.id);
}

void Scheduler::Impl::retire(Entry& e, FinishReason reason) {
  finished_reports.push_back({e.id, reason, e.generated, {}});
  if (reason == FinishReason::Cancelled) {
    ++stats.cancelled;
  } else {
    ++stats.finished;
  }
  release(e);
}

void Scheduler::Impl::reject(Entry& e, std::string reason) {
  rejected_reports.push_back({e.id, "request " + std::to_string(e.id) + " can never run: " + std::move(reason)});
  ++stats.rejected;
  release(e);
}

void Scheduler::Impl::retire_vanished(Entry& e) {
  if (e.done) std::replace(done.begin(), done.end(), &e, static_cast<Entry*>(nullptr));
  std::string note = "request " + std::to_string(e.id) + "'s sequence left the cache outside the scheduler (" +
                     std::string(to_string(e.state)) + ", " + std::to_string(e.generated) +
                     " tokens generated): its KV memory is gone";
  finished_reports.push_back({e.id, FinishReason::Cancelled, e.generated, std::move(note)});
  ++stats.cancelled;
  ++stats.vanished;
  release(e);
}

// Every request that holds memory is looked at once a step where the
// scheduler would touch its sequence next: swapped and prefilling ones at
// the start of the step; Running ones (the bulk, at no cost on the common
// path) when the decode batch's handles turn out stale, or before pressure
// relief, which may touch any of them.
void Scheduler::Impl::sweep_vanished(std::vector<Entry*>* decodes) {
  std::vector<Entry*> gone;
  for (Entry& e : swapped) {
    if (vanished(e)) gone.push_back(&e);
  }
  if (prefilling > 0 || decodes != nullptr) {
    for (Entry& e : running) {
      if ((decodes != nullptr || e.state == RequestState::Prefilling) && vanished(e)) gone.push_back(&e);
    }
  }
  if (gone.empty()) return;
  if (decodes != nullptr) {
    std::erase_if(*decodes, [&](Entry* e) { return std::find(gone.begin(), gone.end(), e) != gone.end(); });
  }
  for (Entry* e : gone) retire_vanished(*e);
}

void Scheduler::Impl::schedule_chunk(Entry& e, std::int32_t end, StepOutput& out) {
  PrefillChunk chunk;
  chunk.id = e.id;
  chunk.slot = e.slot;
  chunk.start = e.computed;
  chunk.end = end;
  chunk.last = end == e.prompt.num_tokens();
  out.num_batched_tokens += end - e.computed;
  stats.prefill_tokens += end - e.computed;
  e.computed = end;
  // Rows stored FP16 are the content's too under content identity.
  if (prefix_caching() && !e.keys.empty() && (!e.exact || content_prefix())) publishing.push_back(e.id);
  if (chunk.last) {
    if (e.exact) planning.push_back(&e);  // demoted to its plan at the next step
    set_state(e, RequestState::Running);
    ++e.generated;
    if (e.generated >= e.max_new_tokens) {
      e.done = true;
      done.push_back(&e);
    }
  }
  out.prefills.push_back(std::move(chunk));
}

Scheduler::Scheduler(KVCacheManager& cache, SchedulerConfig config, std::shared_ptr<PlanSource> planner)
    : impl_(std::make_unique<Impl>(cache, std::move(config), std::move(planner))) {}
Scheduler::~Scheduler() = default;

const SchedulerConfig& Scheduler::config() const { return impl_->config; }
const KVCacheManager& Scheduler::cache() const { return impl_->cache; }
std::shared_ptr<PlanSource> Scheduler::planner() const { return impl_->planner; }

void Scheduler::add_request(const Request& r) {
  Impl& s = *impl_;
  const std::string name = "request (id " + std::to_string(r.id) + ")";
  if (s.entries.contains(r.id)) {
    throw InvalidArgument("request.id = " + std::to_string(r.id) + " is a live request, expected a new id");
  }
  if (r.layout.num_tokens() < 1) {
    throw InvalidArgument(name + ": request.layout has 0 tokens, expected at least one segment");
  }
  if (r.max_new_tokens < 1) {
    throw InvalidArgument(name + ": request.max_new_tokens = " + std::to_string(r.max_new_tokens) + ", expected >= 1");
  }
  if (!std::isfinite(r.arrival_time)) {
    throw InvalidArgument(name + ": request.arrival_time is not finite, expected a time on the engine's clock");
  }
  if (r.plan && r.embeddings) {
    throw InvalidArgument(name +
                          ": request has both a plan and embeddings, expected at most one of request.plan and "
                          "request.embeddings");
  }
  if (!r.token_keys.empty() && r.token_keys.size() != static_cast<std::size_t>(r.layout.num_tokens())) {
    throw InvalidArgument(name + ": request.token_keys has " + std::to_string(r.token_keys.size()) +
                          " keys, expected none or one per prompt row (" + std::to_string(r.layout.num_tokens()) + ")");
  }
  if (static_cast<std::int64_t>(r.layout.num_tokens()) + r.max_new_tokens > std::numeric_limits<std::int32_t>::max()) {
    throw InvalidArgument(name + ": request.max_new_tokens = " + std::to_string(r.max_new_tokens) +
                          " makes more than 2^31 - 1 tokens");
  }
  PrecisionPlan plan;
  if (r.embeddings) {
    if (!s.planner) {
      throw InvalidArgument(name + ": request.embeddings given but config.planner is not set, expected request.plan");
    }
    std::vector<PrecisionPlan> plans =
        s.planner->plan(std::span<const TokenLayout>(&r.layout, 1), std::span<const EmbeddingsView>(&*r.embeddings, 1));
    if (plans.size() != 1) {
      throw InvalidArgument(name + ": the planner returned " + std::to_string(plans.size()) +
                            " plans for one request, expected 1");
    }
    plan = std::move(plans.front());
  } else if (r.plan) {
    plan = *r.plan;
  } else {
    // A text prompt (or visual tokens nobody planned): all FP16, scores 0.
    plan = PrecisionPlan(s.num_layers, r.layout.num_windows(s.block_size), Precision::FP16);
  }
  BlockCounts demand{};
  try {
    demand = s.cache.demand(r.layout, plan);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(name + (r.embeddings ? ": the planner's plan: " : ": request.") + e.what());
  }

  Entry& e = s.entries[r.id];
  e.id = r.id;
  e.neg_priority = s.config.policy == SchedulingPolicy::Priority ? -r.priority : 0;
  e.arrival = r.arrival_time;
  e.order = s.next_order++;
  e.original = r.layout;
  e.max_new_tokens = r.max_new_tokens;
  e.prompt = r.layout;
  e.plan = std::move(plan);
  e.demand = demand;
  e.fp16_demand = demand;
  if (s.exact_mode()) s.refresh_demand(e);  // the all-FP16 demand too
  e.window_starts = r.layout.window_starts(s.block_size);
  e.keys = r.token_keys;
  for (std::int32_t w = 1; w < e.plan.num_windows(); ++w) e.demote_order.push_back(w);
  std::stable_sort(e.demote_order.begin(), e.demote_order.end(),
                   [&](std::int32_t a, std::int32_t b) { return e.plan.score(a) < e.plan.score(b); });
  s.retired.erase(r.id);
  if (auto reason = s.never_fits(e)) {
    s.reject(e, *std::move(reason));
    return;
  }
  s.waiting.insert(e);
}

StepOutput Scheduler::step() {
  Impl& s = *impl_;
  StepOutput out;
  out.step = ++s.stats.steps;
  if (!s.speculating.empty()) s.reject_drafts();  // the last step's drafts that accept() did not take
  // Rows the last step stored, before anything leaves with them.
  if (!s.publishing.empty()) s.publish_stored();

  // Requests whose last token came out of the previous step.
  for (Entry* e : s.done) {
    if (e != nullptr) s.retire(*e, FinishReason::Length);
  }
  s.done.clear();
  s.sweep_vanished(nullptr);
  // Exact prompts completed earlier: their plans' demotions, made below
  // with any pressure demotion in one manager call.
  Impl::PlanDemotions plans;
  if (!s.planning.empty()) s.collect_plans(plans);
  if (!s.tiers.empty()) s.collect_ages(plans);  // after the plans': tiers never take their windows

  std::int32_t budget = s.config.max_num_batched_tokens;

  // 1. Decodes: every running request past its prompt gets one token. One
  // pass over the entries finds the FP16 need and the batch; pressure
  // relief (rare) changes the batch and it is listed again.
  std::vector<Entry*> decodes = s.decoding;
  std::vector<SequenceHandle> handles;
  bool sharing = false;  // some request of the batch may share an FP16 tail (fork)
  auto list_batch = [&] {
    const std::size_t n = decodes.size();
    out.decodes.resize(n);
    out.decode_slots.resize(n);
    handles.resize(n);
    std::int64_t opening = 0;
    sharing = false;
    for (std::size_t i = 0; i < n; ++i) {
      const Entry* e = decodes[i];
      out.decodes[i] = e->id;
      out.decode_slots[i] = e->slot;
      handles[i] = e->handle;
      opening += e->num_tokens % s.block_size == 0 ? 1 : 0;  // every layer opens an FP16 block
      sharing = sharing || e->shares_tail;
    }
    return opening * s.num_layers + (sharing ? s.tail_copies(decodes) : 0);
  };
  std::int64_t need = list_batch();
  const bool relieved = !s.room_for(need + s.demote_headroom, plans);
  if (relieved) {
    s.sweep_vanished(&decodes);
    need = list_batch();
    s.relieve(decodes, need, plans, out);
    need = list_batch();
  } else if (!plans.list.empty() || !plans.complete.empty() || !plans.advances.empty()) {
    s.commit_demotions(plans.list, plans, out);
  }
  // Draft rows (speculative decoding) only with memory to spare.
  const bool drafting = s.wants_drafts() && s.assign_drafts(decodes, need, relieved);
  const AppendSlots form = s.config.per_layer_slots ? AppendSlots::PerLayer : AppendSlots::Compact;
  auto append = [&] {
    const std::span<const SequenceHandle> batch(handles);
    return drafting ? s.cache.append_tokens(batch, s.draft_counts(decodes), form) : s.cache.append_tokens(batch, form);
  };
  try {
    out.append = append();
  } catch (const UnknownId&) {
    // A stale handle: that request's sequence vanished. The append changed
    // nothing; without it the batch needs no more room than was ensured.
    s.sweep_vanished(&decodes);
    list_batch();
    out.append = append();
  }
  for (Entry* e : decodes) {
    if (sharing && e->shares_tail) e->shares_tail = s.tail_shared(*e);
    ++e->num_tokens;
    ++e->generated;
    if (e->generated >= e->max_new_tokens) {
      e->done = true;
      s.done.push_back(e);
    }
  }
  const auto rows = static_cast<std::int32_t>(decodes.size()) + (drafting ? s.commit_drafts(decodes, out) : 0);
  budget -= rows;
  out.num_batched_tokens += rows;
  s.stats.decode_tokens += static_cast<std::int64_t>(decodes.size());

  // 2. Prompts already admitted go on, oldest first.
  for (auto it = s.running.begin(); s.prefilling > 0 && it != s.running.end();) {
    Entry& e = *it++;
    if (budget == 0) break;
    if (e.state != RequestState::Prefilling) continue;
    const std::int32_t end = s.chunk_end(e, budget, e.computed);
    if (end == 0) continue;
    budget -= end - e.computed;
    s.schedule_chunk(e, end, out);
  }

  // 3. Swapped requests come back before new ones are admitted; nothing
  // comes in during a step that had to preempt (no preempt/resume thrash).
  const bool preempted = !out.preempted.empty() || !out.swapped_out.empty();
  auto room = [&] { return static_cast<std::int32_t>(s.running.size()) < s.config.max_num_seqs; };
  while (!preempted && !s.swapped.empty() && room()) {
    Entry& e = *s.swapped.begin();
    if (!s.fits(s.cache.blocks_held(e.id), true)) break;
    const std::vector<SwapCopy> copies = s.cache.swap_in(e.id);
    out.swap_in.insert(out.swap_in.end(), copies.begin(), copies.end());
    out.swapped_in.push_back(e.id);
    out.tables_changed.push_back(e.id);
    s.swapped.erase(s.swapped.iterator_to(e));
    s.set_state(e, e.computed == e.prompt.num_tokens() ? RequestState::Running : RequestState::Prefilling);
    e.table = &s.cache.page_table(e.id);
    s.take_slot(e);
    s.running.insert(e);
  }

  // 4. Admission with bounded look-ahead: the first waiting request that
  // does not fit lets up to `lookahead` others past it, for at most
  // max_head_bypass steps.
  if (!preempted && s.swapped.empty()) {
    Entry* blocked = nullptr;
    std::int32_t looked = 0;
    for (auto it = s.waiting.begin(); it != s.waiting.end() && room() && budget > 0;) {
      Entry& e = *it++;
      const Impl::Admission a = s.admission(e, budget);
      if (a.end != 0 && s.fits(a.demand, true, a.match ? &*a.match : nullptr)) {
        s.waiting.erase(s.waiting.iterator_to(e));
        e.exact = a.exact;
        s.add_to_cache(e, a);
        e.handle = s.cache.handle(e.id);
        s.set_state(e, RequestState::Prefilling);
        e.num_tokens = e.prompt.num_tokens();
        e.table = &s.cache.page_table(e.id);
        s.take_slot(e);
        s.running.insert(e);
        out.tables_changed.push_back(e.id);
        budget -= a.end - e.computed;
        s.schedule_chunk(e, a.end, out);
        continue;
      }
      if (blocked == nullptr) {
        blocked = &e;
        if (++e.bypassed > s.config.max_head_bypass) break;  // drain: nothing past it
      }
      if (++looked > s.config.lookahead) break;
    }
  }

  // Slots of the prefill chunks' rows, per layer.
  for (PrefillChunk& chunk : out.prefills) {
    if (!s.config.build_mappings) break;
    chunk.mappings.resize(static_cast<std::size_t>(s.num_layers));
    for (std::int32_t layer = 0; layer < s.num_layers; ++layer) {
      StoreMapping whole = s.cache.prefill_mapping(chunk.id, layer);
      StoreMapping& m = chunk.mappings[static_cast<std::size_t>(layer)];
      m.fp16_slots.assign(whole.fp16_slots.begin() + chunk.start, whole.fp16_slots.begin() + chunk.end);
      for (auto [windows, part] :
           {std::pair{&whole.int4_windows, &m.int4_windows}, std::pair{&whole.int2_windows, &m.int2_windows}}) {
        for (const WindowSlot& w : *windows) {
          if (w.first_row >= chunk.start && w.first_row < chunk.end)
            part->push_back({w.block_id, w.first_row - chunk.start});
        }
      }
    }
  }

  if (!s.forked.empty()) s.list_forked(out);
  if (s.config.build_metadata) s.build_metadata(decodes, out);
  s.last_decodes = out.decodes;
  out.finished = std::move(s.finished_reports);
  out.rejected = std::move(s.rejected_reports);
  s.finished_reports.clear();
  s.rejected_reports.clear();
  s.reporting.clear();
  return out;
}

bool Scheduler::Impl::end_by_caller(RequestId id, FinishReason reason) {
  const auto it = entries.find(id);
  if (it == entries.end()) {
    if (retired.contains(id)) return false;
    throw UnknownId("id = " + std::to_string(id) + " was never added to this scheduler");
  }
  Entry& e = it->second;
  if (e.done) std::replace(done.begin(), done.end(), &e, static_cast<Entry*>(nullptr));
  retire(e, reason);
  return true;
}

bool Scheduler::finish(RequestId id) { return impl_->end_by_caller(id, FinishReason::Stopped); }

bool Scheduler::cancel(RequestId id) { return impl_->end_by_caller(id, FinishReason::Cancelled); }

bool Scheduler::contains(RequestId id) const { return impl_->entries.contains(id); }

RequestStatus Scheduler::status(RequestId id) const {
  if (!impl_->entries.contains(id)) {
    if (const auto it = impl_->reporting.find(id); it != impl_->reporting.end()) return it->second;
  }
  const Entry& e = impl_->live(id, "id");
  RequestStatus st{e.state, e.prompt.num_tokens(), e.computed, e.generated, e.slot, e.preemptions, e.drafts};
  st.plan_pending = e.exact;
  st.cached_tokens = e.cached;
  return st;
}

SchedulerStats Scheduler::stats() const {
  const Impl& s = *impl_;
  SchedulerStats st = s.stats;
  st.waiting = static_cast<std::int32_t>(s.waiting.size());
  st.swapped = static_cast<std::int32_t>(s.swapped.size());
  st.running = 0;
  st.prefilling = 0;
  for (const Entry& e : s.running) (e.state == RequestState::Running ? st.running : st.prefilling) += 1;
  return st;
}

bool Scheduler::has_unfinished() const {
  const Impl& s = *impl_;
  return !s.entries.empty() || !s.finished_reports.empty() || !s.rejected_reports.empty();
}

}  // namespace mixkv
