#include "mixkv/engine/engine.h"

#include <string>
#include <utility>

#include "mixkv/core/errors.h"

namespace mixkv {

#if !defined(MIXKV_ENGINE_CUDA)
std::unique_ptr<Backend> make_cuda_backend(const BackendConfig&) {
  throw InvalidArgument("make_cuda_backend: mixkv was built without CUDA: expected BackendKind::CPU");
}
#endif

namespace {

BackendConfig backend_config(const EngineConfig& c) {
  BackendConfig b;
  b.cache = c.cache;
  b.num_q_heads = c.num_q_heads;
  b.max_num_seqs = c.scheduler.max_num_seqs;
  b.max_prefill_rows = c.scheduler.max_num_batched_tokens;
  b.cuda_device = c.cuda_device;
  b.sm_scale = c.sm_scale;
  b.max_blocks_per_sequence = c.max_blocks_per_sequence;
  b.batch_invariant_blocks = c.batch_invariant_blocks;
  return b;
}

std::unique_ptr<Backend> make_backend(const EngineConfig& c) {
  switch (c.backend) {
    case BackendKind::CPU: return make_cpu_backend(backend_config(c));
    case BackendKind::CUDA: return make_cuda_backend(backend_config(c));
  }
  throw InvalidArgument("Engine: config.backend = " + std::to_string(static_cast<int>(c.backend)) +
                        ": expected BackendKind::CPU (0) or BackendKind::CUDA (1)");
}

}  // namespace

struct Engine::Impl {
  EngineConfig config;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Scheduler> scheduler;
  StepOutput last;
  bool stepped = false;

  void require_step(const char* fn) const {
    if (!stepped) throw InvalidArgument(std::string(fn) + ": no step yet: expected step() first");
  }
  DeviceKind device() const { return backend->kind() == BackendKind::CUDA ? DeviceKind::CUDA : DeviceKind::CPU; }
  // q, k, v, out (and lse) of `n` query rows on the engine's device.
  void require_rows(const char* fn, std::int64_t n, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const TensorView* lse) const {
    const CacheShape& shape = config.cache.shape;
    const std::int32_t dev = config.cuda_device;
    require_tensor(fn, "q", q, shape.dtype, device(), dev, {n, config.num_q_heads, shape.head_dim});
    require_tensor(fn, "k", k, shape.dtype, device(), dev, {n, shape.num_kv_heads, shape.head_dim});
    require_tensor(fn, "v", v, shape.dtype, device(), dev, {n, shape.num_kv_heads, shape.head_dim});
    require_tensor(fn, "out", out, shape.dtype, device(), dev, {n, config.num_q_heads, shape.head_dim});
    if (lse != nullptr) require_tensor(fn, "lse", *lse, DType::F32, device(), dev, {n, config.num_q_heads});
  }
};

Engine::Engine(EngineConfig config, std::shared_ptr<PlanSource> planner) : impl_(std::make_unique<Impl>()) {
  const std::int32_t kv = config.cache.shape.num_kv_heads;
  if (config.num_q_heads <= 0 || kv <= 0 || config.num_q_heads % kv != 0) {
    throw InvalidArgument("Engine: config.num_q_heads = " + std::to_string(config.num_q_heads) +
                          ": expected a positive multiple of cache.shape.num_kv_heads = " + std::to_string(kv));
  }
  impl_->config = std::move(config);
  impl_->backend = make_backend(impl_->config);
  impl_->scheduler =
      std::make_unique<Scheduler>(impl_->backend->manager(), impl_->config.scheduler, std::move(planner));
}

Engine::~Engine() {
  // The scheduler drives the backend's manager: it goes first.
  impl_->scheduler.reset();
}

const EngineConfig& Engine::config() const { return impl_->config; }
Scheduler& Engine::scheduler() { return *impl_->scheduler; }
const Scheduler& Engine::scheduler() const { return *impl_->scheduler; }
Backend& Engine::backend() { return *impl_->backend; }
const KVCacheManager& Engine::cache() const { return impl_->backend->manager(); }

void Engine::add_request(const Request& request) { impl_->scheduler->add_request(request); }

void Engine::fork(RequestId parent, RequestId child, std::int32_t max_new_tokens) {
  impl_->scheduler->fork(parent, child, max_new_tokens);
}

void Engine::speculate(RequestId id, std::int32_t num_drafts) { impl_->scheduler->speculate(id, num_drafts); }
void Engine::accept(RequestId id, std::int32_t num_accepted) { impl_->scheduler->accept(id, num_accepted); }

bool Engine::finish(RequestId id) { return impl_->scheduler->finish(id); }
bool Engine::cancel(RequestId id) { return impl_->scheduler->cancel(id); }
bool Engine::has_unfinished() const { return impl_->scheduler->has_unfinished(); }

const StepOutput& Engine::step() {
  Impl& s = *impl_;
  StepOutput next = s.scheduler->step();
  // The scheduler has made its changes: the backend must follow them, or
  // the bytes no longer match the books. It refuses only a step that
  // breaks its config, which the scheduler's own config rules out.
  s.backend->apply(next, *s.scheduler);
  s.last = std::move(next);
  s.stepped = true;
  return s.last;
}

void Engine::store(std::int32_t layer, const TensorView& k, const TensorView& v) {
  const Impl& s = *impl_;
  s.require_step("Engine::store");
  std::int64_t rows = 0;
  for (const PrefillChunk& c : s.last.prefills) rows += c.end - c.start;
  const CacheShape& shape = s.config.cache.shape;
  const std::int32_t dev = s.config.cuda_device;
  require_tensor("Engine::store", "k", k, shape.dtype, s.device(), dev, {rows, shape.num_kv_heads, shape.head_dim});
  require_tensor("Engine::store", "v", v, shape.dtype, s.device(), dev, {rows, shape.num_kv_heads, shape.head_dim});
  s.backend->store(layer, k, v);
}

void Engine::prefill(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const TensorView* lse) {
  const Impl& s = *impl_;
  s.require_step("Engine::prefill");
  std::int64_t rows = 0;
  for (const PrefillChunk& c : s.last.prefills) rows += c.end - c.start;
  s.require_rows("Engine::prefill", rows, q, k, v, out, lse);
  s.backend->prefill(layer, q, k, v, out, lse);
}

void Engine::attend(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const TensorView* lse) {
  const Impl& s = *impl_;
  s.require_step("Engine::attend");
  const std::int64_t rows = s.last.decode_rows.empty() ? static_cast<std::int64_t>(s.last.decodes.size())
                                                       : std::int64_t{s.last.decode_rows.back()};
  s.require_rows("Engine::attend", rows, q, k, v, out, lse);
  s.backend->attend(layer, q, k, v, out, lse);
}

}  // namespace mixkv
