// The CUDA backend: a manager, a device arena, a pinned host swap buffer,
// device page tables and one decode plan a step, and the gpu:: ops over
// them. Everything is enqueued on one stream; nothing here waits for the
// device inside a step (the staging copies wait only for their own copy
// two steps back).
#include <cuda_runtime_api.h>

#include <boost/unordered/unordered_flat_set.hpp>

#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mixkv/cache/prefix_tables.h"
#include "mixkv/core/errors.h"
#include "mixkv/engine/backend.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "mixkv/kernels/device_arena.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/device_status.h"
#include "mixkv/kernels/extend_plan.h"
#include "mixkv/kernels/store.h"
#include "mixkv/kernels/swap.h"
#include "step_inputs.h"

namespace mixkv {

namespace {

using engine_detail::StepInputs;

// Makes the backend's device current for one call and restores the
// caller's afterwards, so that the caller's own device choice is untouched.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MIXKV_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MIXKV_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return device;
}

// Checks the config and selects its device before any CUDA member is built.
const BackendConfig& select_device(const BackendConfig& config) {
  engine_detail::check_config("make_cuda_backend", config);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw InvalidArgument("make_cuda_backend: no CUDA device is visible: expected BackendKind::CPU on this machine");
  }
  if (config.cuda_device < 0 || config.cuda_device >= count) {
    throw InvalidArgument("make_cuda_backend: cuda_device = " + std::to_string(config.cuda_device) +
                          ": expected 0 <= cuda_device < " + std::to_string(count) + " (the visible devices)");
  }
  MIXKV_CUDA_CHECK(cudaSetDevice(config.cuda_device));
  return config;
}

// Every layer of a sequence holds all of its tokens (at least ceil(tokens /
// block_size) blocks), and a list of m blocks means more than (m - 1) *
// block_size tokens; so num_layers * m blocks are held, at most the largest
// pool's num_blocks (every slab in that pool).
std::int32_t list_bound(const BackendConfig& config, const PoolLayout& arena) {
  if (config.max_blocks_per_sequence > 0) return config.max_blocks_per_sequence;
  std::int64_t most = 0;
  for (const PoolView& p : arena.pools) most = std::max<std::int64_t>(most, p.num_blocks);
  return static_cast<std::int32_t>(std::max<std::int64_t>(1, most / config.cache.shape.num_layers));
}

// Query-head tiles of a KV head's group at 8 heads an item, the narrower of
// the decode plan's two widths: its tiles are at least the plan's.
std::int32_t head_tiles_bound(std::int32_t group) {
  constexpr std::int32_t kNarrowHeads = 8;
  std::int32_t tiles = 1;
  while (group % tiles != 0 || group / tiles > kNarrowHeads) ++tiles;
  return tiles;
}

// The decode plan of the backend's config. With batch_invariant_blocks its
// item capacity is `invariant_items` (the kernel's own bound assumes every
// sequence of max_batch at its longest lists, gigabytes for a large arena);
// apply() grows it when a step needs more.
gpu::DecodePlanConfig decode_plan_config(const BackendConfig& config, std::int32_t invariant_items) {
  gpu::DecodePlanConfig c;
  c.num_layers = config.cache.shape.num_layers;
  c.num_q_heads = config.num_q_heads;
  c.num_kv_heads = config.cache.shape.num_kv_heads;
  c.head_dim = config.cache.shape.head_dim;
  c.block_size = config.cache.shape.block_size;
  c.max_batch = config.max_num_seqs;
  c.batch_invariant_blocks = config.batch_invariant_blocks;
  if (config.batch_invariant_blocks > 0) c.max_items_per_layer = invariant_items;
  return c;
}

// Items a batch-invariant plan starts with: two chunks for every sequence
// of max_num_seqs, at the narrow width's head tiles.
std::int32_t initial_invariant_items(const BackendConfig& config) {
  const std::int64_t pairs = std::int64_t{config.max_num_seqs} * config.cache.shape.num_kv_heads *
                             head_tiles_bound(config.num_q_heads / config.cache.shape.num_kv_heads);
  return static_cast<std::int32_t>(std::min<std::int64_t>(2 * pairs, std::numeric_limits<std::int32_t>::max()));
}

constexpr std::array<std::pair<Precision, Precision>, 3> kDemotePairs{
    {{Precision::FP16, Precision::INT4}, {Precision::FP16, Precision::INT2}, {Precision::INT4, Precision::INT2}}};

int demote_pair(const DemoteOp& op) {
  for (std::size_t i = 0; i < kDemotePairs.size(); ++i) {
    if (kDemotePairs[i].first == op.src_precision && kDemotePairs[i].second == op.dst_precision) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendConfig& config)
      : caller_device_(current_device()),
        config_(select_device(config)),
        device_(config.cuda_device),
        manager_(config.cache),
        layout_(manager_.arena_layout()),
        arena_(config.cache.arena_bytes),
        pools_(arena_.pool_views(layout_)),
        tables_(gpu::PageTableConfig{config.cache.shape.num_layers, config.max_num_seqs, list_bound(config, layout_)},
                layout_),
        invariant_items_(initial_invariant_items(config)),
        plan_(std::make_unique<gpu::DecodePlan>(decode_plan_config(config, invariant_items_), tables_)),
        mappings_(static_cast<std::size_t>(config.cache.shape.num_layers)),
        synced_(static_cast<std::size_t>(config.max_num_seqs), kNoRequest) {
    if (manager_.swap_bytes() > 0) {
      swap_.emplace(manager_.swap_layout());
      host_pools_ = swap_->device_views(manager_.swap_layout());
    }
    cudaSetDevice(caller_device_);
  }

  ~CudaBackend() override {
    // The members free device memory of this device.
    cudaSetDevice(device_);
  }

  BackendKind kind() const override { return BackendKind::CUDA; }
  const BackendConfig& config() const override { return config_; }
  KVCacheManager& manager() override { return manager_; }
  const KVCacheManager& manager() const override { return manager_; }

  void store(std::int32_t layer, const TensorView& k, const TensorView& v) override {
    engine_detail::check_store("CudaBackend::store", inputs_, config_, layer, k, v, DeviceKind::CUDA, device_, 16);
    if (inputs_.rows == 0) return;
    const DeviceGuard guard(device_);
    launch_store(layer, k, v);
  }

  void prefill(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView* lse) override {
    engine_detail::check_prefill("CudaBackend::prefill", inputs_, config_, layer, q, k, v, out, lse, DeviceKind::CUDA,
                                 device_, 16);
    if (inputs_.rows == 0) return;
    const DeviceGuard guard(device_);
    // The prefixes are the same for every layer: their page lists go into
    // tables of their own (slot c: chunk c) and are planned once a step.
    if (!prefix_planned_) plan_prefix();
    run_extend(*prefix_plan_, layer, q, k, v, out, lse);
    launch_store(layer, k, v);
  }

  void attend(std::int32_t layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const TensorView* lse) override {
    engine_detail::check_attend("CudaBackend::attend", inputs_, config_, layer, q, k, v, out, lse, DeviceKind::CUDA,
                                device_, 16);
    if (inputs_.batch == 0) return;
    const DeviceGuard guard(device_);
    gpu::AppendArgs append;
    append.k = k.data;
    append.v = v.data;
    append.dtype = k.dtype;
    append.fp16_slots = device_ints_.get() + slots_offset_ + static_cast<std::size_t>(layer) * inputs_.decode_rows;
    append.batch = inputs_.decode_rows;
    append.fp16_pool = pools_[pool_index(Precision::FP16)];
    append.stream = stream_;
    append.status = &status_;
    gpu::append(append);
    if (!inputs_.decode_indptr.empty()) {
      // Drafts: extend attention, the rows from k and v (verify_plan_ leaves
      // them out of the pages they were just appended to).
      run_extend(*verify_plan_, layer, q, k, v, out, lse);
      return;
    }
    gpu::DecodeRunArgs run;
    run.layer = layer;
    run.q = q.data;
    run.out = out.data;
    run.dtype = q.dtype;
    run.lse = lse != nullptr ? static_cast<float*>(lse->data) : nullptr;
    run.sm_scale = engine_detail::sm_scale(config_);
    run.pools = pools_;
    run.stream = stream_;
    plan_->run(run);
  }

  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  void synchronize() override {
    const DeviceGuard guard(device_);
    status_.check(stream_);
  }

 protected:
  void apply_step(const StepOutput& step, const Scheduler* scheduler) override {
    constexpr const char* fn = "CudaBackend::apply";
    const DeviceGuard guard(device_);
    status_.raise_if_set(stream_);
    engine_detail::check_step(fn, step, manager_, config_);
    check_device_step(fn, step);
    engine_detail::build_inputs(step, manager_, inputs_);
    const auto batch = static_cast<std::size_t>(inputs_.batch);

    // One copy a step for every id list the kernels read: the demote moves
    // of each pool pair, the copy-on-write copies, then the append slots
    // [layer][batch].
    std::array<std::vector<BlockCopy>, kDemotePairs.size()> moves;
    for (const DemoteOp& op : step.demotions) {
      moves[static_cast<std::size_t>(demote_pair(op))].push_back({op.src_block, op.dst_block});
    }
    std::size_t ints = 0;
    std::array<std::size_t, kDemotePairs.size() + 1> offsets{};
    for (std::size_t i = 0; i < moves.size(); ++i) {
      offsets[i] = ints;
      ints += 2 * moves[i].size();
    }
    offsets[moves.size()] = ints;
    ints += 2 * step.append.copies.size();
    slots_offset_ = ints;
    ints += inputs_.slots.size();
    if (ints > 0) {
      Staging& st = staging_[turn_];
      turn_ ^= 1;
      st.copied.synchronize();  // its copy from two steps back
      st.ints.reserve(ints);
      std::int32_t* h = st.ints.get();
      for (std::size_t i = 0; i < moves.size(); ++i) {
        std::copy_n(reinterpret_cast<const std::int32_t*>(moves[i].data()), 2 * moves[i].size(), h + offsets[i]);
      }
      std::copy_n(reinterpret_cast<const std::int32_t*>(step.append.copies.data()), 2 * step.append.copies.size(),
                  h + offsets[moves.size()]);
      std::copy(inputs_.slots.begin(), inputs_.slots.end(), h + slots_offset_);
      device_ints_.reserve(ints, stream_);
      MIXKV_CUDA_CHECK(
          cudaMemcpyAsync(device_ints_.get(), h, ints * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
      st.copied.record(stream_);
    }

    // 1. Demotions, one launch a pool pair.
    for (std::size_t i = 0; i < moves.size(); ++i) {
      if (moves[i].empty()) continue;
      gpu::DemoteArgs args;
      args.moves = reinterpret_cast<const BlockCopy*>(device_ints_.get() + offsets[i]);
      args.count = static_cast<std::int32_t>(moves[i].size());
      args.src_pool = pools_[pool_index(kDemotePairs[i].first)];
      args.dst_pool = pools_[pool_index(kDemotePairs[i].second)];
      args.stream = stream_;
      args.status = &status_;
      gpu::demote(args);
    }
    // 2, 3. Swaps, one launch a direction, each through its own list (an
    // upload waits for its list's previous staging copy).
    swap(step.swap_out, SwapDirection::DeviceToHost, swap_out_list_);
    swap(step.swap_in, SwapDirection::HostToDevice, swap_in_list_);
    // 4. Copy-on-write copies.
    if (!step.append.copies.empty()) {
      gpu::CopyBlocksArgs args;
      args.copies = reinterpret_cast<const BlockCopy*>(device_ints_.get() + offsets[moves.size()]);
      args.count = static_cast<std::int32_t>(step.append.copies.size());
      args.pool = pools_[pool_index(Precision::FP16)];
      args.stream = stream_;
      args.status = &status_;
      gpu::copy_blocks(args);
    }
    // Page tables of the batch (only entries that changed are uploaded),
    // the decode plan, and every layer's prefill mapping.
    sync_tables(step, scheduler != nullptr);
    tables_.upload(stream_);
    if (batch > 0 && inputs_.decode_indptr.empty()) {
      if (config_.batch_invariant_blocks > 0) reserve_invariant_items(step.decode_slots);
      plan_->plan(step.decode_slots, stream_);
    }
    if (batch > 0 && !inputs_.decode_indptr.empty()) {
      if (!verify_plan_) verify_plan_ = make_extend_plan(tables_);
      std::vector<std::int32_t> exclude(batch);
      for (std::size_t i = 0; i < batch; ++i) exclude[i] = inputs_.decode_indptr[i + 1] - inputs_.decode_indptr[i];
      verify_plan_->plan(step.decode_slots, inputs_.decode_indptr, stream_, exclude);
    }
    prefix_planned_ = false;
    if (inputs_.rows > 0) {
      for (std::size_t l = 0; l < mappings_.size(); ++l) mappings_[l].upload(inputs_.mappings[l], layout_, stream_);
    }
  }

 private:
  struct Staging {
    gpu::detail::PinnedBuffer<std::int32_t> ints;
    gpu::detail::Event copied;
  };

  // What the device ops would refuse, refused before anything is enqueued.
  void check_device_step(const char* fn, const StepOutput& step) const {
    for (std::size_t i = 0; i < step.demotions.size(); ++i) {
      if (demote_pair(step.demotions[i]) < 0) {
        throw InvalidArgument(std::string(fn) + ": step.demotions[" + std::to_string(i) +
                              "]: expected (FP16, INT4), (FP16, INT2) or (INT4, INT2) as (src, dst) precisions");
      }
    }
    if (!swap_ && (!step.swap_out.empty() || !step.swap_in.empty())) {
      throw InvalidArgument(std::string(fn) +
                            ": step.swap_out / swap_in: expected none without a host swap pool (cache.swap_blocks)");
    }
    if (!step.decode_rows.empty() && step.decode_rows.back() > extend_rows()) {
      throw InvalidArgument(std::string(fn) + ": step.decode_rows ends at " + std::to_string(step.decode_rows.back()) +
                            " rows: expected <= max_prefill_rows = " + std::to_string(extend_rows()) +
                            " (the rows one extend plan holds)");
    }
    const std::int32_t bound = tables_.config().max_blocks_per_sequence;
    for (std::size_t i = 0; i < step.decodes.size(); ++i) {
      const PageTable& t = manager_.page_table(step.decodes[i]);
      for (std::int32_t l = 0; l < t.num_layers(); ++l) {
        for (const Precision p : kAllPrecisions) {
          if (t.blocks(l, p).size() > static_cast<std::size_t>(bound)) {
            throw InvalidArgument(std::string(fn) + ": step.decodes[" + std::to_string(i) + "] holds " +
                                  std::to_string(t.blocks(l, p).size()) + " " + std::string(to_string(p)) +
                                  " blocks in layer " + std::to_string(l) +
                                  ": expected <= max_blocks_per_sequence = " + std::to_string(bound));
          }
        }
      }
    }
  }

  // The device page tables of the decode batch. A scheduler's step lists
  // every table that changed other than at its FP16 end (tables_changed),
  // so a decode still synced from its slot's last refresh only has its
  // FP16 tails compared (DevicePageTables::sync_tail): the host cost of a
  // step then grows with the batch, not with the tokens it holds. Without a
  // scheduler a harness may have edited any list, so every table is
  // compared whole.
  void sync_tables(const StepOutput& step, bool from_scheduler) {
    if (from_scheduler) {
      for (const RequestId id : step.tables_changed) stale_.insert(id);
      for (const FinishedRequest& f : step.finished) stale_.erase(f.id);
    }
    const bool drafts = !step.decode_rows.empty();
    for (std::size_t i = 0; i < step.decodes.size(); ++i) {
      const RequestId id = step.decodes[i];
      const std::int32_t slot = step.decode_slots[i];
      RequestId& owner = synced_[static_cast<std::size_t>(slot)];
      const PageTable& table = manager_.page_table(id);
      const bool current = from_scheduler && owner == id && !stale_.contains(id);
      if (!current || !tables_.sync_tail(slot, table)) tables_.sync(slot, table);
      owner = from_scheduler ? id : kNoRequest;
      // accept() truncates a verified sequence's drafts and the next step
      // may append other blocks in their place: its next sync is whole.
      if (drafts) {
        stale_.insert(id);
      } else {
        stale_.erase(id);
      }
    }
  }

  // A batch-invariant plan holds the items its config's capacity allows,
  // and a step may need more (gpu::DecodePlan::invariant_items_needed): it
  // is then rebuilt with at least twice the items, after the stream has
  // drained (the old plan's buffers may still be read). The same config but
  // the capacity, so the same chunks and the same bits.
  void reserve_invariant_items(std::span<const std::int32_t> slots) {
    const std::int64_t need = plan_->invariant_items_needed(slots);
    if (need <= invariant_items_) return;
    const auto items = static_cast<std::int32_t>(std::min<std::int64_t>(
        std::max<std::int64_t>(need, 2 * std::int64_t{invariant_items_}), std::numeric_limits<std::int32_t>::max()));
    MIXKV_CUDA_CHECK(cudaStreamSynchronize(stream_));
    plan_ = std::make_unique<gpu::DecodePlan>(decode_plan_config(config_, items), tables_);
    invariant_items_ = items;
  }

  void launch_store(std::int32_t layer, const TensorView& k, const TensorView& v) {
    gpu::StorePrefillArgs args;
    mappings_[static_cast<std::size_t>(layer)].fill(args);
    args.k = k.data;
    args.v = v.data;
    args.dtype = k.dtype;
    args.pools = pools_;
    args.stream = stream_;
    gpu::store_prefill(args);
  }

  // Rows one extend plan takes: the step's token budget (max_prefill_rows),
  // which bounds prefill rows and decode rows alike.
  std::int32_t extend_rows() const {
    return config_.max_prefill_rows > 0 ? config_.max_prefill_rows : kDefaultExtendRows;
  }

  std::unique_ptr<gpu::ExtendPlan> make_extend_plan(const gpu::DevicePageTables& tables) const {
    const CacheShape& s = config_.cache.shape;
    return std::make_unique<gpu::ExtendPlan>(
        gpu::ExtendPlanConfig{s.num_layers, config_.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size,
                              config_.max_num_seqs, extend_rows()},
        tables);
  }

  // The page lists before each prefill chunk into prefix_tables_ (slot c:
  // chunk c) and one extend plan over them.
  void plan_prefix() {
    if (!prefix_tables_) {
      prefix_tables_.emplace(gpu::PageTableConfig{config_.cache.shape.num_layers, config_.max_num_seqs,
                                                  tables_.config().max_blocks_per_sequence},
                             layout_);
      prefix_plan_ = make_extend_plan(*prefix_tables_);
    }
    const DecodeMetadata prefix = prefix_metadata(manager_, inputs_.chunk_ids, inputs_.chunk_starts);
    const std::int32_t bound = prefix_tables_->config().max_blocks_per_sequence;
    std::vector<std::int32_t> slots(inputs_.chunk_ids.size());
    for (std::size_t c = 0; c < slots.size(); ++c) {
      slots[c] = static_cast<std::int32_t>(c);
      for (std::size_t l = 0; l < prefix.layers.size(); ++l) {
        for (const Precision p : kAllPrecisions) {
          const PagedPoolTable& t = prefix.layers[l][pool_index(p)];
          const std::span<const std::int32_t> list(t.indices.data() + t.indptr[c],
                                                   static_cast<std::size_t>(t.indptr[c + 1] - t.indptr[c]));
          if (list.size() > static_cast<std::size_t>(bound)) {
            throw InvalidArgument("CudaBackend::prefill: step.prefills[" + std::to_string(c) + "] reads " +
                                  std::to_string(list.size()) + " " + std::string(to_string(p)) + " blocks in layer " +
                                  std::to_string(l) +
                                  ": expected <= max_blocks_per_sequence = " + std::to_string(bound));
          }
          prefix_tables_->set_blocks(slots[c], static_cast<std::int32_t>(l), p, list, t.last_block_len[c]);
        }
      }
    }
    prefix_tables_->upload(stream_);
    prefix_plan_->plan(slots, inputs_.qo_indptr, stream_);
    prefix_planned_ = true;
  }

  void run_extend(const gpu::ExtendPlan& plan, std::int32_t layer, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& out, const TensorView* lse) const {
    gpu::ExtendRunArgs run;
    run.layer = layer;
    run.q = q.data;
    run.k = k.data;
    run.v = v.data;
    run.out = out.data;
    run.dtype = q.dtype;
    run.lse = lse != nullptr ? static_cast<float*>(lse->data) : nullptr;
    run.sm_scale = engine_detail::sm_scale(config_);
    run.pools = pools_;
    run.stream = stream_;
    plan.run(run);
  }

  void swap(const std::vector<SwapCopy>& copies, SwapDirection direction, gpu::DeviceSwapList& list) {
    if (copies.empty()) return;
    list.upload(copies, direction, layout_, manager_.swap_layout(), stream_);
    gpu::SwapBlocksArgs args;
    list.fill(args);
    args.device = pools_;
    args.host = host_pools_;
    args.stream = stream_;
    args.status = &status_;
    gpu::swap_blocks(args);
  }

  int caller_device_ = 0;  // current when the constructor ran, restored by it
  BackendConfig config_;
  int device_ = 0;
  KVCacheManager manager_;
  PoolLayout layout_;
  gpu::DeviceArena arena_;
  gpu::DevicePools pools_;
  std::optional<gpu::PinnedSwapBuffer> swap_;
  gpu::DevicePools host_pools_{};
  gpu::DevicePageTables tables_;
  // Work items a layer of the batch-invariant decode plan holds (unused
  // without batch_invariant_blocks); grown by reserve_invariant_items().
  std::int32_t invariant_items_ = 0;
  std::unique_ptr<gpu::DecodePlan> plan_;
  // Extend attention, made on first use: prefill() through the cache
  // (prefix_tables_ hold the page lists before each chunk) and decodes
  // with drafts (over tables_).
  static constexpr std::int32_t kDefaultExtendRows = 8192;
  std::optional<gpu::DevicePageTables> prefix_tables_;
  std::unique_ptr<gpu::ExtendPlan> prefix_plan_;
  std::unique_ptr<gpu::ExtendPlan> verify_plan_;
  bool prefix_planned_ = false;
  std::vector<gpu::DeviceStoreMapping> mappings_;  // [layer], uploaded in apply()
  // [slot]: the request tables_ last synced that slot from (kNoRequest when
  // unknown), and requests whose tables changed since then other than at
  // their FP16 end (sync_tables).
  static constexpr RequestId kNoRequest = std::numeric_limits<RequestId>::min();
  std::vector<RequestId> synced_;
  boost::unordered_flat_set<RequestId> stale_;
  gpu::DeviceSwapList swap_out_list_;
  gpu::DeviceSwapList swap_in_list_;
  gpu::DeviceStatus status_;
  std::array<Staging, 2> staging_;
  int turn_ = 0;
  gpu::detail::DeviceBuffer<std::int32_t> device_ints_;
  std::size_t slots_offset_ = 0;
  cudaStream_t stream_ = nullptr;
  StepInputs inputs_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendConfig& config) {
  return std::make_unique<CudaBackend>(config);
}

}  // namespace mixkv
