// The CPU backend: a manager, a host arena and a host swap buffer, and the
// ops of mixkv/cpu/ over them. Every call runs to completion.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "mixkv/cache/prefix_tables.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/span16.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/extend_attention.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"
#include "mixkv/engine/cpu_backend.h"
#include "step_inputs.h"

namespace mixkv {

namespace {

using engine_detail::StepInputs;

// calloc: pages are touched only when KV bytes are written, and malloc's
// 16-byte alignment is what every block format needs inside a slab.
struct FreeBytes {
  void operator()(std::byte* p) const { std::free(p); }
};
using HostBytes = std::unique_ptr<std::byte, FreeBytes>;

HostBytes host_bytes(std::size_t bytes, const char* name) {
  auto* p = static_cast<std::byte*>(std::calloc(bytes == 0 ? 1 : bytes, 1));
  if (p == nullptr) {
    throw OutOfMemory(std::string("make_cpu_backend: ") + name + " = " + std::to_string(bytes) +
                      ": the host cannot allocate it, expected less");
  }
  return HostBytes(p);
}

class CpuBackendImpl final : public CpuBackend {
 public:
  explicit CpuBackendImpl(const BackendConfig& config)
      : config_((engine_detail::check_config("make_cpu_backend", config), config)),
        manager_(config.cache),
        arena_(host_bytes(config.cache.arena_bytes, "cache.arena_bytes")),
        swap_(host_bytes(manager_.swap_bytes(), "swap_bytes()")),
        pools_(manager_.arena_layout().at(arena_.get())),
        host_pools_(manager_.swap_layout().at(swap_.get())) {}

  BackendKind kind() const override { return BackendKind::CPU; }
  const BackendConfig& config() const override { return config_; }
  KVCacheManager& manager() override { return manager_; }
  const KVCacheManager& manager() const override { return manager_; }

  void store(std::int32_t layer, const TensorView& k, const TensorView& v) override {
    engine_detail::check_store("CpuBackend::store", inputs_, config_, layer, k, v, DeviceKind::CPU, 0, 2);
    if (inputs_.rows == 0) return;
    cpu::store_prefill(values16(k), values16(v), inputs_.mappings[static_cast<std::size_t>(layer)], pools_);
  }

  void prefill(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView* lse) override {
    engine_detail::check_prefill("CpuBackend::prefill", inputs_, config_, layer, q, k, v, out, lse, DeviceKind::CPU, 0,
                                 alignof(float));
    if (inputs_.rows == 0) return;
    // The prefixes are the same for every layer's call: built once a step.
    if (!prefix_built_) {
      prefix_ = prefix_metadata(manager_, inputs_.chunk_ids, inputs_.chunk_starts);
      prefix_built_ = true;
    }
    const auto rows = static_cast<std::size_t>(inputs_.rows) * static_cast<std::size_t>(config_.num_q_heads);
    out_f32_.resize(rows * static_cast<std::size_t>(config_.cache.shape.head_dim));
    lse_f32_.resize(rows);
    cpu::ExtendAttentionArgs args;
    args.qo_indptr = inputs_.qo_indptr;
    args.q = values16(q);
    args.k = values16(k);
    args.v = values16(v);
    args.num_q_heads = config_.num_q_heads;
    args.sm_scale = engine_detail::sm_scale(config_);
    args.tables = &prefix_.layers[static_cast<std::size_t>(layer)];
    args.pools = pools_;
    args.out = out_f32_;
    args.lse = lse != nullptr ? std::span<float>(static_cast<float*>(lse->data), rows) : std::span<float>(lse_f32_);
    cpu::extend_attention(args);
    cpu::store_prefill(values16(k), values16(v), inputs_.mappings[static_cast<std::size_t>(layer)], pools_);
    write_out(out);
  }

  void attend(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const TensorView* lse) override {
    engine_detail::check_attend("CpuBackend::attend", inputs_, config_, layer, q, k, v, out, lse, DeviceKind::CPU, 0,
                                alignof(float));
    const auto n = static_cast<std::size_t>(inputs_.decode_rows);
    if (n == 0) return;
    const std::span<const std::int32_t> slots(inputs_.slots.data() + static_cast<std::size_t>(layer) * n, n);
    cpu::append(values16(k), values16(v), slots, pools_[pool_index(Precision::FP16)]);
    const auto rows = n * static_cast<std::size_t>(config_.num_q_heads);
    out_f32_.resize(rows * static_cast<std::size_t>(config_.cache.shape.head_dim));
    lse_f32_.resize(rows);
    const std::span<float> lse_out =
        lse != nullptr ? std::span<float>(static_cast<float*>(lse->data), rows) : std::span<float>(lse_f32_);
    if (inputs_.decode_indptr.empty()) {
      cpu::DecodeAttentionArgs args;
      args.q = values16(q);
      args.num_q_heads = config_.num_q_heads;
      args.sm_scale = engine_detail::sm_scale(config_);
      args.tables = &metadata_.layers[static_cast<std::size_t>(layer)];
      args.pools = pools_;
      args.out = out_f32_;
      args.lse = lse_out;
      cpu::decode_attention(args);
    } else {
      // Drafts: the rows come from k, v (causal among a decode's rows), the
      // pages without them (verify_tables_).
      cpu::ExtendAttentionArgs args;
      args.qo_indptr = inputs_.decode_indptr;
      args.q = values16(q);
      args.k = values16(k);
      args.v = values16(v);
      args.num_q_heads = config_.num_q_heads;
      args.sm_scale = engine_detail::sm_scale(config_);
      args.tables = &verify_tables_.layers[static_cast<std::size_t>(layer)];
      args.pools = pools_;
      args.out = out_f32_;
      args.lse = lse_out;
      cpu::extend_attention(args);
    }
    write_out(out);
  }

  void set_stream(void*) override {}
  void synchronize() override {}

  PoolViews arena_pools() const override { return pools_; }
  PoolViews swap_pools() const override { return host_pools_; }

 protected:
  void apply_step(const StepOutput& step, const Scheduler*) override {
    engine_detail::check_step("CpuBackend::apply", step, manager_, config_);
    // The ops check their lists before they write (a failed op writes
    // nothing); the scheduler's lists pass those checks by construction.
    cpu::demote(step.demotions, pools_);
    cpu::swap_blocks(step.swap_out, SwapDirection::DeviceToHost, pools_, host_pools_);
    cpu::swap_blocks(step.swap_in, SwapDirection::HostToDevice, pools_, host_pools_);
    cpu::copy_blocks(step.append.copies, pools_[pool_index(Precision::FP16)]);
    engine_detail::build_inputs(step, manager_, inputs_);
    prefix_built_ = false;
    // Metadata as of this step, kept whole: a request cancelled before
    // attend() leaves its blocks unused until the next step, so reading
    // them then is still reading its tokens.
    if (!step.metadata.layers.empty()) {
      metadata_ = step.metadata;
    } else {
      metadata_ = manager_.decode_metadata(step.decodes);
    }
    if (!inputs_.decode_indptr.empty()) {
      verify_tables_ = metadata_;
      engine_detail::drop_fp16_tails(verify_tables_, inputs_.decode_indptr, config_.cache.shape.block_size);
    }
  }

 private:
  // q, k, v in the cache's 16-bit type (the checks before each op made sure).
  static Span16 values16(const TensorView& t) {
    return {static_cast<const std::byte*>(t.data), static_cast<std::size_t>(t.numel()), t.dtype};
  }

  // The float result into out, rounded to out's (the cache's) 16-bit type.
  void write_out(const TensorView& out) const {
    auto* o = static_cast<std::uint16_t*>(out.data);
    for (std::size_t i = 0; i < out_f32_.size(); ++i) o[i] = float16_bits(out.dtype, out_f32_[i]);
  }

  BackendConfig config_;
  KVCacheManager manager_;
  HostBytes arena_;
  HostBytes swap_;
  PoolViews pools_;
  PoolViews host_pools_;
  StepInputs inputs_;
  DecodeMetadata metadata_;
  DecodeMetadata prefix_;         // prefill(): the page lists before each chunk
  DecodeMetadata verify_tables_;  // drafts: metadata_ without each decode's rows
  bool prefix_built_ = false;
  std::vector<float> out_f32_;
  std::vector<float> lse_f32_;
};

}  // namespace

std::unique_ptr<CpuBackend> CpuBackend::create(const BackendConfig& config) {
  return std::make_unique<CpuBackendImpl>(config);
}

std::unique_ptr<Backend> make_cpu_backend(const BackendConfig& config) { return CpuBackend::create(config); }

}  // namespace mixkv
