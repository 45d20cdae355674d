// mixkv.Scheduler: continuous batching over a KVCacheManager (scheduler.h),
// with its request, configuration and step-output types. The scheduler keeps
// its cache alive; calls hold the GIL, which serializes threads sharing them.
#include <string>
#include <vector>

#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "host_arrays.h"
#include "mixkv/core/errors.h"
#include "mixkv/scheduler/scheduler.h"

namespace mixkv::python {
namespace {

// A Request whose embeddings are a NumPy array (float32, float16 or
// bfloat16 [num_tokens, hidden]), read only during add_request().
struct PyRequest {
  Request request;
  py::object embeddings = py::none();
};

EmbeddingsView request_embeddings(const py::object& obj) {
  const std::string where = "add_request: request.embeddings";
  if (!py::isinstance<py::array>(obj))
    throw InvalidArgument(where + ": expected a 2-D NumPy array, got " + type_name(obj));
  const auto a = py::reinterpret_borrow<py::array>(obj);
  const std::string dtype = py::str(a.dtype().attr("name"));
  const ElementType type =
      dtype == "float32"   ? ElementType::F32
      : dtype == "float16" ? ElementType::F16
      : dtype == "bfloat16"
          ? ElementType::BF16
          : throw InvalidArgument(where + ": expected dtype float32, float16 or bfloat16, got " + dtype);
  const py::array checked =
      check_host_array(a, where, dtype.c_str(), std::vector<Dim>{{kAny, "tokens"}, {kAny, "hidden"}}, false);
  return {checked.data(), type, checked.shape(0), static_cast<std::int32_t>(checked.shape(1))};
}

}  // namespace

void bind_scheduler(py::module_& m) {
  py::native_enum<SchedulingPolicy>(m, "SchedulingPolicy", "enum.IntEnum", "Order of admission.")
      .value("FCFS", SchedulingPolicy::FCFS, "earliest arrival_time first")
      .value("Priority", SchedulingPolicy::Priority, "highest priority first, then FCFS")
      .finalize();
  py::native_enum<PreemptionMode>(m, "PreemptionMode", "enum.IntEnum", "What happens to a preempted request.")
      .value("Recompute", PreemptionMode::Recompute, "free its blocks, prefill prompt + generated tokens again later")
      .value("Swap", PreemptionMode::Swap, "copy its blocks to the host swap pool and back later")
      .finalize();
  py::native_enum<PrefillMode>(m, "PrefillMode", "enum.IntEnum",
                               "How a prompt prefilled in several chunks is stored while it is prefilled.")
      .value("Compact", PrefillMode::Compact, "each window at its plan's precision as its chunk completes")
      .value("Exact", PrefillMode::Exact,
             "every window FP16 until the prompt is done, then demoted to the plan (needs fp16_windows_first)")
      .finalize();
  py::native_enum<RequestState>(m, "RequestState", "enum.IntEnum", "Where a request stands.")
      .value("Waiting", RequestState::Waiting)
      .value("Prefilling", RequestState::Prefilling)
      .value("Running", RequestState::Running)
      .value("Swapped", RequestState::Swapped)
      .value("Finished", RequestState::Finished)
      .finalize();
  py::native_enum<FinishReason>(m, "FinishReason", "enum.IntEnum", "Why a request left.")
      .value("Length", FinishReason::Length, "generated max_new_tokens")
      .value("Stopped", FinishReason::Stopped, "the engine called finish()")
      .value("Cancelled", FinishReason::Cancelled, "cancel()")
      .finalize();

  const AgeTierPolicy tier_defaults;
  py::class_<AgeTierPolicy>(m, "AgeTierPolicy", init_only(),
                            "Age tiers (KIVI-style): keep the sink and the most recent windows FP16, demote older "
                            "ones between steps to a precision per layer (scheduler_config.h).")
      .def(py::init([](bool enabled, std::int32_t sink_windows, std::int32_t recent_windows,
                       std::vector<Precision> layer_floor) {
             AgeTierPolicy a;
             a.enabled = enabled;
             a.sink_windows = sink_windows;
             a.recent_windows = recent_windows;
             a.layer_floor = std::move(layer_floor);
             return a;
           }),
           py::kw_only(), py::arg("enabled") = true, py::arg("sink_windows") = tier_defaults.sink_windows,
           py::arg("recent_windows") = tier_defaults.recent_windows, py::arg("layer_floor") = tier_defaults.layer_floor)
      .def_readwrite("enabled", &AgeTierPolicy::enabled)
      .def_readwrite("sink_windows", &AgeTierPolicy::sink_windows,
                     "windows holding any of the first sink_windows * block_size positions stay FP16")
      .def_readwrite("recent_windows", &AgeTierPolicy::recent_windows,
                     "a window is old once recent_windows * block_size tokens follow it (>= 1)")
      .def_readwrite("layer_floor", &AgeTierPolicy::layer_floor,
                     "precision of old windows per layer (FP16 keeps a layer); empty: INT4 everywhere");

  const SchedulerConfig defaults;
  py::class_<SchedulerConfig>(m, "SchedulerConfig", init_only(), "Configuration of a Scheduler (scheduler_config.h).")
      .def(py::init([](std::int32_t max_num_seqs, std::int32_t max_num_batched_tokens, bool chunked_prefill,
                       SchedulingPolicy policy, double watermark, bool demote_under_pressure,
                       std::int32_t max_demotions_per_step, PreemptionMode preemption, std::int32_t lookahead,
                       std::int32_t max_head_bypass, bool build_metadata, bool per_layer_slots, bool build_mappings,
                       std::int32_t num_speculative_tokens, PrefillMode prefill_mode,
                       std::optional<PlannerConfig> planner, AgeTierPolicy age_tiers) {
             // Field by field: the struct may grow (the defaults stay the C++ ones).
             SchedulerConfig c;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.chunked_prefill = chunked_prefill;
             c.policy = policy;
             c.watermark = watermark;
             c.demote_under_pressure = demote_under_pressure;
             c.max_demotions_per_step = max_demotions_per_step;
             c.preemption = preemption;
             c.lookahead = lookahead;
             c.max_head_bypass = max_head_bypass;
             c.build_metadata = build_metadata;
             c.per_layer_slots = per_layer_slots;
             c.build_mappings = build_mappings;
             c.num_speculative_tokens = num_speculative_tokens;
             c.prefill_mode = prefill_mode;
             c.planner = std::move(planner);
             c.age_tiers = std::move(age_tiers);
             return c;
           }),
           py::kw_only(), py::arg("max_num_seqs") = defaults.max_num_seqs,
           py::arg("max_num_batched_tokens") = defaults.max_num_batched_tokens,
           py::arg("chunked_prefill") = defaults.chunked_prefill, py::arg("policy") = defaults.policy,
           py::arg("watermark") = defaults.watermark, py::arg("demote_under_pressure") = defaults.demote_under_pressure,
           py::arg("max_demotions_per_step") = defaults.max_demotions_per_step,
           py::arg("preemption") = defaults.preemption, py::arg("lookahead") = defaults.lookahead,
           py::arg("max_head_bypass") = defaults.max_head_bypass, py::arg("build_metadata") = defaults.build_metadata,
           py::arg("per_layer_slots") = defaults.per_layer_slots, py::arg("build_mappings") = defaults.build_mappings,
           py::arg("num_speculative_tokens") = defaults.num_speculative_tokens,
           py::arg("prefill_mode") = defaults.prefill_mode, py::arg("planner") = py::none(),
           py::arg("age_tiers") = defaults.age_tiers)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("chunked_prefill", &SchedulerConfig::chunked_prefill)
      .def_readwrite("policy", &SchedulerConfig::policy)
      .def_readwrite("watermark", &SchedulerConfig::watermark)
      .def_readwrite("demote_under_pressure", &SchedulerConfig::demote_under_pressure)
      .def_readwrite("max_demotions_per_step", &SchedulerConfig::max_demotions_per_step)
      .def_readwrite("preemption", &SchedulerConfig::preemption)
      .def_readwrite("lookahead", &SchedulerConfig::lookahead)
      .def_readwrite("max_head_bypass", &SchedulerConfig::max_head_bypass)
      .def_readwrite("build_metadata", &SchedulerConfig::build_metadata)
      .def_readwrite("per_layer_slots", &SchedulerConfig::per_layer_slots,
                     "fill StepOutput.append.slots; off, only the compact form")
      .def_readwrite("build_mappings", &SchedulerConfig::build_mappings, "fill PrefillChunk.mappings")
      .def_readwrite("num_speculative_tokens", &SchedulerConfig::num_speculative_tokens,
                     "draft tokens a Running request gets in each decode step (Scheduler.speculate sets one "
                     "request's next step instead); 0: plain decoding. Capped by the request's remaining tokens, "
                     "the step's token budget and free memory (never a demotion or preemption for drafts)")
      .def_readwrite("prefill_mode", &SchedulerConfig::prefill_mode,
                     "Compact: windows stored at their plan as chunks complete; Exact: FP16 while the prompt is "
                     "prefilled (chunks read FP16 keys), then demoted to the plan")
      .def_readwrite("planner", &SchedulerConfig::planner)
      .def_readwrite("age_tiers", &SchedulerConfig::age_tiers,
                     "demote windows older than the recent ones between steps (off by default; needs the cache's "
                     "fp16_windows_first)");

  py::class_<PyRequest>(m, "Request", init_only(),
                        "A generation request: its prompt layout and exactly one of a plan or the prompt's "
                        "embeddings (a NumPy array [num_tokens, hidden], for the scheduler's planner).")
      .def(py::init([](RequestId id, const TokenLayout& layout, std::optional<PrecisionPlan> plan,
                       py::object embeddings, std::int32_t max_new_tokens, std::int32_t priority, double arrival_time,
                       std::vector<TokenKey> token_keys) {
             PyRequest r;
             r.request.token_keys = std::move(token_keys);
             r.request.id = id;
             r.request.layout = layout;
             r.request.plan = std::move(plan);
             r.request.max_new_tokens = max_new_tokens;
             r.request.priority = priority;
             r.request.arrival_time = arrival_time;
             r.embeddings = std::move(embeddings);
             return r;
           }),
           py::arg("id"), py::arg("layout"), py::kw_only(), py::arg("plan") = py::none(),
           py::arg("embeddings") = py::none(), py::arg("max_new_tokens") = 1, py::arg("priority") = 0,
           py::arg("arrival_time") = 0.0, py::arg("token_keys") = std::vector<TokenKey>{})
      .def_property(
          "id", [](const PyRequest& r) { return r.request.id; }, [](PyRequest& r, RequestId v) { r.request.id = v; })
      .def_property(
          "layout", [](const PyRequest& r) { return r.request.layout; },
          [](PyRequest& r, const TokenLayout& v) { r.request.layout = v; })
      .def_property(
          "plan", [](const PyRequest& r) { return r.request.plan; },
          [](PyRequest& r, std::optional<PrecisionPlan> v) { r.request.plan = std::move(v); })
      .def_readwrite("embeddings", &PyRequest::embeddings)
      .def_property(
          "max_new_tokens", [](const PyRequest& r) { return r.request.max_new_tokens; },
          [](PyRequest& r, std::int32_t v) { r.request.max_new_tokens = v; })
      .def_property(
          "priority", [](const PyRequest& r) { return r.request.priority; },
          [](PyRequest& r, std::int32_t v) { r.request.priority = v; })
      .def_property(
          "arrival_time", [](const PyRequest& r) { return r.request.arrival_time; },
          [](PyRequest& r, double v) { r.request.arrival_time = v; })
      .def_property(
          "token_keys", [](const PyRequest& r) { return r.request.token_keys; },
          [](PyRequest& r, std::vector<TokenKey> v) { r.request.token_keys = std::move(v); },
          "Prefix caching: each prompt row's content key (a text token's id, the engine's 64-bit hash of a "
          "visual token's embedding); empty: the request neither shares nor publishes cached blocks.");

  py::class_<PrefillChunk>(m, "PrefillChunk", init_only(),
                           "Prompt rows [start, end) of a request computed in this step.")
      .def_readonly("id", &PrefillChunk::id)
      .def_readonly("slot", &PrefillChunk::slot, "the request's page-table slot")
      .def_readonly("start", &PrefillChunk::start)
      .def_readonly("end", &PrefillChunk::end)
      .def_readonly("last", &PrefillChunk::last, "completes the prompt: the engine samples a token")
      .def_readonly("mappings", &PrefillChunk::mappings,
                    "[layer] StoreMapping of rows [start, end): chunk row r is mapping row r - start");
  py::class_<FinishedRequest>(m, "FinishedRequest", init_only(),
                              "A request that left: why, and how many tokens it generated.")
      .def_readonly("id", &FinishedRequest::id)
      .def_readonly("reason", &FinishedRequest::reason)
      .def_readonly("generated", &FinishedRequest::generated)
      .def_readonly("note", &FinishedRequest::note,
                    "Empty unless the scheduler ended the request itself (its sequence left the cache).");
  py::class_<RejectedRequest>(m, "RejectedRequest", init_only(), "A request that can never fit, with the reason.")
      .def_readonly("id", &RejectedRequest::id)
      .def_readonly("reason", &RejectedRequest::reason);

  py::class_<StepOutput>(m, "StepOutput", init_only(),
                         "What the engine does in one step, in this order: demotions (ops.demote), swap_out copies, "
                         "swap_in copies (ops.swap_blocks), append.copies (ops.copy_blocks), then the forward pass: "
                         "prefill chunks (store_prefill through their mappings) and the decode batch (append K/V at "
                         "append.slots, decode attention over metadata).")
      .def_readonly("step", &StepOutput::step)
      .def_readonly("prefills", &StepOutput::prefills)
      .def_readonly("decodes", &StepOutput::decodes, "the decode batch, in batch order")
      .def_property_readonly("decode_slots", [](const StepOutput& o) { return int32_array(o.decode_slots); })
      .def_readonly("append", &StepOutput::append,
                    "the decode rows' FP16 slots: append.slots [num_layers, rows], rows = len(decodes), or "
                    "decode_rows[-1] when some decode has drafts")
      .def_property_readonly(
          "decode_rows", [](const StepOutput& o) { return int32_array(o.decode_rows); },
          "int32 [len(decodes) + 1] row offsets (FlashInfer's qo_indptr) when some decode has drafts, else empty: "
          "decodes[i] has rows decode_rows[i] .. decode_rows[i + 1] - 1, its last sampled token first, then its "
          "drafts, all stored this step (causal among them). After verifying them, Scheduler.accept each decode "
          "with drafts.")
      .def_readonly("demotions", &StepOutput::demotions)
      .def_readonly("plan_demotions", &StepOutput::plan_demotions,
                    "demotions[0:plan_demotions] apply the plans of prompts prefilled FP16 (PrefillMode.Exact)")
      .def_readonly("age_demotions", &StepOutput::age_demotions,
                    "demotions[plan_demotions:plan_demotions + age_demotions] demote windows that aged "
                    "(SchedulerConfig.age_tiers); stream block k appears as window plan.num_windows + k")
      .def_readonly("swap_out", &StepOutput::swap_out)
      .def_readonly("swap_in", &StepOutput::swap_in)
      .def_readonly("swapped_out", &StepOutput::swapped_out)
      .def_readonly("swapped_in", &StepOutput::swapped_in)
      .def_readonly("preempted", &StepOutput::preempted)
      .def_readonly("tables_changed", &StepOutput::tables_changed)
      .def_readonly("finished", &StepOutput::finished)
      .def_readonly("rejected", &StepOutput::rejected)
      .def_readonly("num_batched_tokens", &StepOutput::num_batched_tokens)
      .def_readonly("metadata", &StepOutput::metadata, "decode metadata of `decodes` (when build_metadata)");

  py::class_<RequestStatus>(m, "RequestStatus", init_only(), "A request's progress.")
      .def_readonly("state", &RequestStatus::state)
      .def_readonly("prompt_tokens", &RequestStatus::prompt_tokens)
      .def_readonly("computed_tokens", &RequestStatus::computed_tokens)
      .def_readonly("generated", &RequestStatus::generated)
      .def_readonly("slot", &RequestStatus::slot)
      .def_readonly("preemptions", &RequestStatus::preemptions)
      .def_readonly("plan_pending", &RequestStatus::plan_pending,
                    "exact prefill: the plan's demotions are not all made yet")
      .def_readonly("drafts", &RequestStatus::drafts, "draft tokens of the last step awaiting accept()")
      .def_readonly("cached_tokens", &RequestStatus::cached_tokens,
                    "prompt rows its last admission took from the prefix cache (its first chunk starts there)");
  py::class_<SchedulerStats>(m, "SchedulerStats", init_only(), "Queue sizes and counters since the scheduler was made.")
      .def_readonly("steps", &SchedulerStats::steps)
      .def_readonly("waiting", &SchedulerStats::waiting)
      .def_readonly("prefilling", &SchedulerStats::prefilling)
      .def_readonly("running", &SchedulerStats::running)
      .def_readonly("swapped", &SchedulerStats::swapped)
      .def_readonly("finished", &SchedulerStats::finished)
      .def_readonly("rejected", &SchedulerStats::rejected)
      .def_readonly("cancelled", &SchedulerStats::cancelled)
      .def_readonly("vanished", &SchedulerStats::vanished)
      .def_readonly("forks", &SchedulerStats::forks)
      .def_readonly("preempted_recompute", &SchedulerStats::preempted_recompute)
      .def_readonly("preempted_swap", &SchedulerStats::preempted_swap)
      .def_readonly("demotions", &SchedulerStats::demotions, "pressure demotions")
      .def_readonly("plan_demotions", &SchedulerStats::plan_demotions, "demotions applying exact-mode plans")
      .def_readonly("plan_waits", &SchedulerStats::plan_waits, "steps a request's plan demotions waited for blocks")
      .def_readonly("age_demotions", &SchedulerStats::age_demotions, "(window, layer) demotions made by age tiers")
      .def_readonly("age_waits", &SchedulerStats::age_waits, "steps a request's age demotions waited for blocks")
      .def_readonly("decode_tokens", &SchedulerStats::decode_tokens)
      .def_readonly("prefill_tokens", &SchedulerStats::prefill_tokens)
      .def_readonly("draft_tokens", &SchedulerStats::draft_tokens, "draft rows scheduled (speculative decoding)")
      .def_readonly("accepted_tokens", &SchedulerStats::accepted_tokens, "of them, accepted (accept())")
      .def_readonly("prefix_hits", &SchedulerStats::prefix_hits, "admissions that shared cached blocks")
      .def_readonly("cached_prompt_tokens", &SchedulerStats::cached_prompt_tokens,
                    "prompt rows taken from the prefix cache (not in prefill_tokens)")
      .def_readonly("shared_blocks", &SchedulerStats::shared_blocks, "cached blocks those admissions shared")
      .def_readonly("published_blocks", &SchedulerStats::published_blocks,
                    "blocks the requests' computed prompts gave the prefix index");

  py::class_<Scheduler>(m, "Scheduler", init_only(),
                        "The continuous-batching scheduler over `cache` (which must start empty; while the scheduler "
                        "lives nothing else may add, free, append, swap or demote its sequences). add_request() as "
                        "requests arrive, step() once per engine step, finish() on EOS.")
      .def(py::init<KVCacheManager&, SchedulerConfig>(), py::arg("cache"), py::arg("config") = SchedulerConfig{},
           py::keep_alive<1, 2>())
      .def_property_readonly(
          "config", [](const Scheduler& self) -> SchedulerConfig { return self.config(); },
          "A copy: editing it changes nothing here (configure a new object with it).")
      .def(
          "add_request",
          [](Scheduler& s, const PyRequest& r) {
            Request request = r.request;
            if (!r.embeddings.is_none()) request.embeddings = request_embeddings(r.embeddings);
            s.add_request(request);
          },
          py::arg("request"),
          "Queues a request (ValueError naming request.<field> for a malformed one). One that can never fit is "
          "reported in the next step's `rejected`.")
      .def("step", &Scheduler::step, "Schedules the next step.")
      .def("finish", &Scheduler::finish, py::arg("id"),
           "Ends a request (EOS): frees what it holds; False when it has already left; KeyError for an id never "
           "added.")
      .def("cancel", &Scheduler::cancel, py::arg("id"), "Cancels a request in any state; idempotent.")
      .def("fork", &Scheduler::fork, py::arg("parent"), py::arg("child"), py::arg("max_new_tokens") = -1,
           "Parallel sampling: `child` shares every block of the Running `parent` and decodes from the next step; "
           "max_new_tokens counts its tokens after the fork (-1: as many as the parent has left). MemoryError "
           "when no slot is free (retry later); ValueError/KeyError otherwise, changing nothing.")
      .def("speculate", &Scheduler::speculate, py::arg("id"), py::arg("num_drafts"),
           "Speculative decoding: the draft tokens `id` asks for in its next decode step instead of "
           "config.num_speculative_tokens (capped the same way); the steps after use the default again. KeyError "
           "for a request that is not live; ValueError naming num_drafts below 0.")
      .def("accept", &Scheduler::accept, py::arg("id"), py::arg("num_accepted"),
           "After verifying the last step's decode of `id`: its first num_accepted drafts (0 .. "
           "status(id).drafts) were accepted. The rejected ones leave the cache, and the step counts "
           "num_accepted + 1 generated tokens (the accepted drafts, then the token sampled after them, whose K/V "
           "the next step stores as its first row). Drafts not accepted before the next step() are all rejected "
           "there. ValueError for a request without drafts awaiting acceptance, or naming num_accepted out of "
           "range; KeyError for a request that is not live.")
      .def("contains", &Scheduler::contains, py::arg("id"))
      .def("__contains__", &Scheduler::contains, py::arg("id"))
      .def("status", &Scheduler::status, py::arg("id"))
      .def("stats", &Scheduler::stats)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("layer_metadata", &Scheduler::layer_metadata, py::arg("layer"),
           "[FP16, INT4, INT2] PagedPoolTable of the last step's decode batch for one layer.")
      .def("check_invariants", &Scheduler::check_invariants)
      .def("describe_state", &Scheduler::describe_state);
}

}  // namespace mixkv::python
