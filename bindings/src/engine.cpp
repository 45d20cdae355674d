// mixkv._engine: the C++ Engine (engine.h) for Python; mixkv.Engine
// (bindings/python/mixkv/engine.py) is the object an engine author uses.
//
// A module of its own beside mixkv._core: it uses _core's classes
// (CacheConfig, SchedulerConfig, TokenLayout, PrecisionPlan, RequestStatus,
// KVCacheManager) and errors through pybind11's shared registry, so
// `import mixkv` must come first (the package does it).
//
// Threads: store(), prefill() and attend() release the GIL while the
// backend works (their arrays are borrowed first, with the GIL); every other
// call keeps it. A per-engine mutex serializes the C++ calls, since the
// engine is not thread-safe and a call without the GIL no longer excludes
// the others.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include "dlpack.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/hash.h"
#include "mixkv/engine/engine.h"

namespace mixkv::python {
namespace {

struct PyEngine {
  explicit PyEngine(EngineConfig config) : engine(std::make_unique<Engine>(std::move(config))) {}
  std::unique_ptr<Engine> engine;
  std::mutex mutex;
  // The step step() returned last (Engine::step's reference, valid until
  // the next step()); null before the first. step_digest() reads it.
  const StepOutput* last_step = nullptr;
};

// Takes the engine's mutex; while another thread holds it (in store or
// attend, without the GIL) waits without the GIL, so that thread can finish.
std::unique_lock<std::mutex> acquire(std::mutex& m) {
  std::unique_lock<std::mutex> lock(m, std::try_to_lock);
  if (!lock.owns_lock()) {
    py::gil_scoped_release release;
    lock.lock();
  }
  return lock;
}

DeviceKind device_of(const EngineConfig& c) {
  return c.backend == BackendKind::CUDA ? DeviceKind::CUDA : DeviceKind::CPU;
}

ArrayExpect expect(const EngineConfig& c, DType dtype, bool writable, std::intptr_t stream) {
  return ArrayExpect{{dtype}, device_of(c), c.cuda_device, writable, stream};
}

// Enqueues what follows on `stream` (CUDA backend; the CPU backend ignores it).
void use_stream(PyEngine& self, std::intptr_t stream) {
  self.engine->backend().set_stream(reinterpret_cast<void*>(stream));
}

// attend() and prefill(): borrows the arrays with the GIL held, then runs
// `op` without it under the engine's mutex.
using AttentionOp = void (Engine::*)(std::int32_t, const TensorView&, const TensorView&, const TensorView&,
                                     const TensorView&, const TensorView*);
void run_attention(PyEngine& self, const char* fn, AttentionOp op, std::int32_t layer, py::handle q, py::handle k,
                   py::handle v, py::handle out, py::handle lse, std::intptr_t stream) {
  const EngineConfig& c = self.engine->config();
  const DType t = c.cache.shape.dtype;  // q, k, v and out are in the cache's 16-bit type
  const BorrowedArray qb = borrow_array(q, fn, "q", expect(c, t, false, stream));
  const BorrowedArray kb = borrow_array(k, fn, "k", expect(c, t, false, stream));
  const BorrowedArray vb = borrow_array(v, fn, "v", expect(c, t, false, stream));
  const BorrowedArray ob = borrow_array(out, fn, "out", expect(c, t, true, stream));
  BorrowedArray lb;
  if (!lse.is_none()) lb = borrow_array(lse, fn, "lse", expect(c, DType::F32, true, stream));
  const TensorView qv = qb.view();
  const TensorView kv = kb.view();
  const TensorView vv = vb.view();
  const TensorView ov = ob.view();
  const TensorView lv = lb.view();
  const bool with_lse = !lse.is_none();
  py::gil_scoped_release release;
  const std::lock_guard<std::mutex> lock(self.mutex);
  use_stream(self, stream);
  ((*self.engine).*op)(layer, qv, kv, vv, ov, with_lse ? &lv : nullptr);
}

py::dict step_dict(const StepOutput& s) {
  py::list prefills;
  for (const PrefillChunk& c : s.prefills) prefills.append(py::make_tuple(c.id, c.start, c.end, c.last));
  py::list finished;
  for (const FinishedRequest& f : s.finished) {
    finished.append(py::make_tuple(f.id, static_cast<int>(f.reason), f.generated, f.note));
  }
  py::list rejected;
  for (const RejectedRequest& r : s.rejected) rejected.append(py::make_tuple(r.id, r.reason));
  py::dict d;
  d["step"] = s.step;
  d["prefills"] = prefills;
  d["decodes"] = py::cast(s.decodes);
  d["decode_rows"] = py::cast(s.decode_rows);
  d["finished"] = finished;
  d["rejected"] = rejected;
  d["swapped_out"] = py::cast(s.swapped_out);
  d["swapped_in"] = py::cast(s.swapped_in);
  d["preempted"] = py::cast(s.preempted);
  d["num_batched_tokens"] = s.num_batched_tokens;
  d["num_demotions"] = s.demotions.size();
  d["num_age_demotions"] = s.age_demotions;
  d["num_swap_out"] = s.swap_out.size();
  d["num_swap_in"] = s.swap_in.size();
  d["num_copies"] = s.append.copies.size();
  return d;
}

// A 64-bit digest of everything a step decided and of the pools' block
// counts after it, for ranks that run identical schedulers to compare
// (mixkv.tp): chained through mix64, every vector preceded by its length so
// that no two different steps feed the same word sequence.
class StepDigest {
 public:
  void add(std::uint64_t v) { h_ = mix64(h_ ^ (v + 0x9e3779b97f4a7c15ULL)); }
  void add_signed(std::int64_t v) { add(static_cast<std::uint64_t>(v)); }
  template <typename T>
  void add_ints(const std::vector<T>& xs) {
    add(xs.size());
    for (const T x : xs) add_signed(static_cast<std::int64_t>(x));
  }
  void add_text(const std::string& text) {
    add(text.size());
    for (const char c : text) add(static_cast<unsigned char>(c));
  }
  void add_windows(const std::vector<WindowSlot>& ws) {
    add(ws.size());
    for (const WindowSlot& w : ws) {
      add_signed(w.block_id);
      add_signed(w.first_row);
    }
  }
  void add_swaps(const std::vector<SwapCopy>& cs) {
    add(cs.size());
    for (const SwapCopy& c : cs) {
      add(static_cast<std::uint64_t>(c.pool));
      add_signed(c.device_block);
      add_signed(c.host_slot);
    }
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 0;
};

std::uint64_t step_digest(const StepOutput& s, const KVCacheManager& cache) {
  StepDigest d;
  d.add_signed(s.step);
  d.add(s.prefills.size());
  for (const PrefillChunk& c : s.prefills) {
    d.add_signed(c.id);
    d.add_signed(c.slot);
    d.add_signed(c.start);
    d.add_signed(c.end);
    d.add(c.last ? 1 : 0);
    d.add(c.mappings.size());
    for (const StoreMapping& m : c.mappings) {
      d.add_ints(m.fp16_slots);
      d.add_windows(m.int4_windows);
      d.add_windows(m.int2_windows);
    }
  }
  d.add_ints(s.decodes);
  d.add_ints(s.decode_slots);
  d.add(s.append.slots.size());
  for (const std::vector<std::int32_t>& layer : s.append.slots) d.add_ints(layer);
  d.add(s.append.copies.size());
  for (const BlockCopy& c : s.append.copies) {
    d.add_signed(c.src);
    d.add_signed(c.dst);
  }
  d.add_ints(s.append.offsets);
  d.add_ints(s.append.tails_changed);
  d.add_ints(s.append.tail_blocks);
  d.add_ints(s.decode_rows);
  d.add(s.demotions.size());
  for (const DemoteOp& op : s.demotions) {
    d.add_signed(op.id);
    d.add_signed(op.layer);
    d.add_signed(op.window);
    d.add(static_cast<std::uint64_t>(op.src_precision));
    d.add_signed(op.src_block);
    d.add(static_cast<std::uint64_t>(op.dst_precision));
    d.add_signed(op.dst_block);
  }
  d.add_signed(s.plan_demotions);
  d.add_signed(s.age_demotions);
  d.add_swaps(s.swap_out);
  d.add_swaps(s.swap_in);
  d.add_ints(s.swapped_out);
  d.add_ints(s.swapped_in);
  d.add_ints(s.preempted);
  d.add_ints(s.tables_changed);
  // The page lists of the requests whose lists changed other than by an
  // append (admitted, swapped in, demoted, forked): appends are in the
  // slots above, so every page list enters a digest whenever it changes,
  // at the cost of the blocks the step itself touched.
  const std::int32_t num_layers = cache.config().shape.num_layers;
  for (const RequestId id : s.tables_changed) {
    const bool resident = cache.contains(id) && !cache.is_swapped(id);
    d.add(resident ? 1 : 0);
    if (!resident) continue;
    for (std::int32_t layer = 0; layer < num_layers; ++layer) {
      for (const Precision p : {Precision::FP16, Precision::INT4, Precision::INT2}) {
        const std::span<const std::int32_t> ids = cache.blocks(id, layer, p);
        d.add(ids.size());
        for (const std::int32_t b : ids) d.add_signed(b);
      }
      d.add_signed(cache.fp16_tail_fill(id, layer));
    }
  }
  d.add(s.finished.size());
  for (const FinishedRequest& f : s.finished) {
    d.add_signed(f.id);
    d.add(static_cast<std::uint64_t>(f.reason));
    d.add_signed(f.generated);
    d.add_text(f.note);
  }
  d.add(s.rejected.size());
  for (const RejectedRequest& r : s.rejected) {
    d.add_signed(r.id);
    d.add_text(r.reason);
  }
  d.add_signed(s.num_batched_tokens);
  d.add_signed(s.metadata.batch_size);
  d.add(s.metadata.layers.size());
  for (const auto& layer : s.metadata.layers) {
    for (const PagedPoolTable& t : layer) {
      d.add_ints(t.indptr);
      d.add_ints(t.indices);
      d.add_ints(t.last_block_len);
    }
  }
  // The pools after the step: a block taken or freed outside the step's
  // lists (a fork, a finish) shows here.
  for (const Precision p : {Precision::FP16, Precision::INT4, Precision::INT2}) {
    const PoolStats st = cache.pool_stats(p);
    d.add_signed(st.slabs);
    d.add_signed(st.used_blocks);
    d.add_signed(st.free_blocks);
    d.add_signed(st.empty_slabs);
  }
  d.add_signed(cache.free_slabs());
  for (const std::int64_t slots : cache.free_swap_slots()) d.add_signed(slots);
  return d.value();
}

py::dict tensor_info(py::handle obj, const std::string& device, std::int32_t device_id, bool writable,
                     std::intptr_t stream) {
  if (device != "cpu" && device != "cuda")
    throw InvalidArgument("tensor_info: device: expected 'cpu' or 'cuda', got '" + device + "'");
  const ArrayExpect e{{DType::F16, DType::BF16, DType::F32, DType::I32},
                      device == "cpu" ? DeviceKind::CPU : DeviceKind::CUDA,
                      device_id,
                      writable,
                      stream};
  const BorrowedArray a = borrow_array(obj, "tensor_info", "array", e);
  const TensorView& v = a.view();
  py::list shape;
  for (std::int32_t i = 0; i < v.ndim; ++i) shape.append(v.shape[static_cast<std::size_t>(i)]);
  py::dict d;
  d["protocol"] = a.protocol();
  d["dtype"] = dtype_name(v.dtype);
  d["device"] = device_name(v.device, v.device_id);
  d["shape"] = py::tuple(shape);
  d["data"] = reinterpret_cast<std::uintptr_t>(v.data);
  return d;
}

}  // namespace
}  // namespace mixkv::python

PYBIND11_MODULE(_engine, m) {
  using namespace mixkv;
  using namespace mixkv::python;
  m.doc() = "The C++ Engine of mixkv (engine.h); mixkv.Engine wraps it. Import mixkv first.";

  // The classes of _core: the same metaclass (no Class.__new__ without
  // __init__) and the argument types below.
  const py::module_ core = py::module_::import("mixkv._core");
  const py::metaclass init_only(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(core.attr("CacheShape").ptr()))));

  py::native_enum<BackendKind>(m, "BackendKind", "enum.IntEnum", "Which backend holds the KV memory.")
      .value("CPU", BackendKind::CPU, "host arena, the ops of mixkv/cpu/")
      .value("CUDA", BackendKind::CUDA, "device arena and kernels (mixkv built with CUDA, a visible GPU)")
      .finalize();

  py::class_<EngineConfig>(m, "EngineConfig", init_only, "Configuration of an Engine (engine.h).")
      .def(py::init([](CacheConfig cache, SchedulerConfig scheduler, std::int32_t num_q_heads, BackendKind backend,
                       std::int32_t cuda_device, float sm_scale, std::int32_t max_blocks_per_sequence,
                       std::int32_t batch_invariant_blocks) {
             EngineConfig c;
             c.cache = std::move(cache);
             c.scheduler = std::move(scheduler);
             c.num_q_heads = num_q_heads;
             c.backend = backend;
             c.cuda_device = cuda_device;
             c.sm_scale = sm_scale;
             c.max_blocks_per_sequence = max_blocks_per_sequence;
             c.batch_invariant_blocks = batch_invariant_blocks;
             return c;
           }),
           py::arg("cache"), py::arg("scheduler"), py::kw_only(), py::arg("num_q_heads"),
           py::arg("backend") = BackendKind::CPU, py::arg("cuda_device") = 0, py::arg("sm_scale") = 0.0f,
           py::arg("max_blocks_per_sequence") = 0, py::arg("batch_invariant_blocks") = 0)
      .def_readwrite("cache", &EngineConfig::cache)
      .def_readwrite("scheduler", &EngineConfig::scheduler)
      .def_readwrite("num_q_heads", &EngineConfig::num_q_heads)
      .def_readwrite("backend", &EngineConfig::backend)
      .def_readwrite("cuda_device", &EngineConfig::cuda_device)
      .def_readwrite("sm_scale", &EngineConfig::sm_scale, "attention scale; 0: 1/sqrt(head_dim)")
      .def_readwrite("max_blocks_per_sequence", &EngineConfig::max_blocks_per_sequence,
                     "CUDA page-table width; 0: what the cache could give one sequence")
      .def_readwrite("batch_invariant_blocks", &EngineConfig::batch_invariant_blocks,
                     "batch-invariant decode's chunk in blocks; 0: off (engine.h)");
  m.attr("BATCH_INVARIANT_BLOCKS") = kBatchInvariantBlocks;

  py::class_<PyEngine, std::unique_ptr<PyEngine>>(
      m, "Engine", init_only,
      "The scheduler and a backend (engine.h), with int64 request ids; mixkv.Engine adds caller ids and "
      "array allocation.")
      .def(py::init([](EngineConfig config) { return std::make_unique<PyEngine>(std::move(config)); }),
           py::arg("config"))
      .def_property_readonly("config", [](PyEngine& self) -> EngineConfig { return self.engine->config(); })
      .def(
          "add_request",
          [](PyEngine& self, RequestId id, const TokenLayout& layout, std::optional<PrecisionPlan> plan,
             py::object embeddings, std::int32_t max_new_tokens, std::int32_t priority, double arrival_time,
             std::vector<TokenKey> token_keys) {
            Request r;
            r.token_keys = std::move(token_keys);
            r.id = id;
            r.layout = layout;
            r.plan = std::move(plan);
            r.max_new_tokens = max_new_tokens;
            r.priority = priority;
            r.arrival_time = arrival_time;
            BorrowedArray e;  // read during add_request only
            if (!embeddings.is_none()) {
              e = borrow_array(embeddings, "Engine.add_request", "embeddings",
                               ArrayExpect{{DType::F32, DType::F16, DType::BF16}, DeviceKind::CPU, 0, false, 0});
              const TensorView& v = e.view();
              if (v.ndim != 2 || v.shape[1] > INT32_MAX) {
                throw InvalidArgument(
                    "Engine.add_request: embeddings: expected a 2-D array [num_tokens, hidden], got "
                    "shape " +
                    shape_text({v.shape.data(), static_cast<std::size_t>(v.ndim)}));
              }
              const ElementType type = v.dtype == DType::F32   ? ElementType::F32
                                       : v.dtype == DType::F16 ? ElementType::F16
                                                               : ElementType::BF16;
              r.embeddings = EmbeddingsView{v.data, type, v.shape[0], static_cast<std::int32_t>(v.shape[1])};
            }
            auto lock = acquire(self.mutex);
            self.engine->add_request(r);
          },
          py::arg("id"), py::arg("layout"), py::kw_only(), py::arg("plan") = py::none(),
          py::arg("embeddings") = py::none(), py::arg("max_new_tokens") = 1, py::arg("priority") = 0,
          py::arg("arrival_time") = 0.0, py::arg("token_keys") = std::vector<TokenKey>{})
      .def(
          "fork",
          [](PyEngine& self, RequestId parent, RequestId child, std::int32_t max_new_tokens) {
            auto lock = acquire(self.mutex);
            self.engine->fork(parent, child, max_new_tokens);
          },
          py::arg("parent"), py::arg("child"), py::arg("max_new_tokens") = -1)
      .def(
          "speculate",
          [](PyEngine& self, RequestId id, std::int32_t num_drafts) {
            auto lock = acquire(self.mutex);
            self.engine->speculate(id, num_drafts);
          },
          py::arg("id"), py::arg("num_drafts"))
      .def(
          "accept",
          [](PyEngine& self, RequestId id, std::int32_t num_accepted) {
            auto lock = acquire(self.mutex);
            self.engine->accept(id, num_accepted);
          },
          py::arg("id"), py::arg("num_accepted"))
      .def(
          "finish",
          [](PyEngine& self, RequestId id) {
            auto lock = acquire(self.mutex);
            return self.engine->finish(id);
          },
          py::arg("id"))
      .def(
          "cancel",
          [](PyEngine& self, RequestId id) {
            auto lock = acquire(self.mutex);
            return self.engine->cancel(id);
          },
          py::arg("id"))
      .def("has_unfinished",
           [](PyEngine& self) {
             auto lock = acquire(self.mutex);
             return self.engine->has_unfinished();
           })
      .def("contains",
           [](PyEngine& self, RequestId id) {
             auto lock = acquire(self.mutex);
             return self.engine->scheduler().contains(id);
           })
      .def(
          "status",
          [](PyEngine& self, RequestId id) {
            auto lock = acquire(self.mutex);
            return self.engine->scheduler().status(id);
          },
          py::arg("id"))
      .def("stats",
           [](PyEngine& self) {
             auto lock = acquire(self.mutex);
             return self.engine->scheduler().stats();
           })
      .def(
          "step",
          [](PyEngine& self, std::intptr_t stream) {
            auto lock = acquire(self.mutex);
            use_stream(self, stream);
            const StepOutput& s = self.engine->step();
            self.last_step = &s;
            return step_dict(s);
          },
          py::arg("stream") = 0, "Schedules the next step and applies its memory moves; a dict of what to run.")
      .def(
          "store",
          [](PyEngine& self, std::int32_t layer, py::handle k, py::handle v, std::intptr_t stream) {
            const EngineConfig& c = self.engine->config();
            const DType t = c.cache.shape.dtype;
            const BorrowedArray kb = borrow_array(k, "Engine.store", "k", expect(c, t, false, stream));
            const BorrowedArray vb = borrow_array(v, "Engine.store", "v", expect(c, t, false, stream));
            const TensorView kv = kb.view();
            const TensorView vv = vb.view();
            py::gil_scoped_release release;
            const std::lock_guard<std::mutex> lock(self.mutex);
            use_stream(self, stream);
            self.engine->store(layer, kv, vv);
          },
          py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("stream") = 0)
      .def(
          "attend",
          [](PyEngine& self, std::int32_t layer, py::handle q, py::handle k, py::handle v, py::handle out,
             py::handle lse, std::intptr_t stream) {
            run_attention(self, "Engine.attend", &Engine::attend, layer, q, k, v, out, lse, stream);
          },
          py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse") = py::none(),
          py::arg("stream") = 0)
      .def(
          "prefill",
          [](PyEngine& self, std::int32_t layer, py::handle q, py::handle k, py::handle v, py::handle out,
             py::handle lse, std::intptr_t stream) {
            run_attention(self, "Engine.prefill", &Engine::prefill, layer, q, k, v, out, lse, stream);
          },
          py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse") = py::none(),
          py::arg("stream") = 0)
      .def(
          "synchronize",
          [](PyEngine& self) {
            py::gil_scoped_release release;
            const std::lock_guard<std::mutex> lock(self.mutex);
            self.engine->backend().synchronize();
          },
          "Waits until every call made so far has finished (CPU: returns at once).")
      .def_property_readonly(
          "cache", [](PyEngine& self) -> const KVCacheManager& { return self.engine->cache(); },
          py::return_value_policy::reference_internal)
      .def("check_invariants",
           [](PyEngine& self) {
             auto lock = acquire(self.mutex);
             self.engine->scheduler().check_invariants();
           })
      .def("describe_state",
           [](PyEngine& self) {
             auto lock = acquire(self.mutex);
             return self.engine->scheduler().describe_state();
           })
      .def(
          "step_digest",
          [](PyEngine& self) -> std::uint64_t {
            auto lock = acquire(self.mutex);
            return self.last_step == nullptr ? 0 : step_digest(*self.last_step, self.engine->cache());
          },
          "A 64-bit digest of the last step() (every id, slot, block id, demotion, swap and copy, the decode "
          "metadata, the page lists of the requests in tables_changed) and of the pools' block counts now; 0 "
          "before the first step. Equal on ranks whose schedulers took the same decisions (mixkv.tp).");

  m.def(
      "tensor_info",
      [](py::handle obj, const std::string& device, std::int32_t device_id, bool writable, std::intptr_t stream) {
        return tensor_info(obj, device, device_id, writable, stream);
      },
      py::arg("array"), py::kw_only(), py::arg("device") = "cpu", py::arg("device_id") = 0, py::arg("writable") = false,
      py::arg("stream") = 0,
      "How an array crosses into mixkv (protocol, dtype, device, shape, data pointer), with the checks every "
      "Engine argument gets: for tests and for diagnosing an array an Engine refuses.");
#ifdef MIXKV_PYTHON_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
