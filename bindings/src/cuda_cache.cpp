// mixkv.cuda: DeviceKVCache, the device page tables and the decode plan
// (FlashInfer's plan/run split: plan once per step on the host, run per layer
// through mixkv.ops.paged_decode_attention), and DeviceStoreMapping.
#include "cuda_cache.h"

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "cuda_arrays.h"
#include "host_arrays.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/store.h"

namespace mixkv::python {

namespace {

// Plan -> the tables it reads, for every DecodePlan made from Python (the
// constructor keeps the tables alive as long as the plan). A plan's entry is
// written when it is made, so one at a freed plan's address is replaced
// before it can be looked up. Guarded by the GIL.
std::unordered_map<const gpu::DecodePlan*, const gpu::DevicePageTables*>& plan_tables() {
  static auto* map = new std::unordered_map<const gpu::DecodePlan*, const gpu::DevicePageTables*>();
  return *map;
}

std::array<std::int32_t, kNumPrecisions> pool_blocks_of(const PoolLayout& layout) {
  std::array<std::int32_t, kNumPrecisions> blocks{};
  for (int p = 0; p < kNumPrecisions; ++p) blocks[p] = layout.pools[p].num_blocks;
  return blocks;
}

}  // namespace

const gpu::DevicePageTables* tables_of(const gpu::DecodePlan& plan) {
  const auto it = plan_tables().find(&plan);
  return it == plan_tables().end() ? nullptr : it->second;
}

namespace {

// mixkv.cuda's ops take their arrays through __cuda_array_interface__,
// which has no bfloat16 type: a BF16 cache is refused before its arena is
// allocated. The kernels take BF16 caches; on the GPU they run through
// mixkv.Engine(backend="cuda"), whose arrays come through DLPack.
const CacheConfig& fp16_config(const CacheConfig& config) {
  if (config.shape.dtype != DType::F16) {
    throw InvalidArgument("DeviceKVCache: config.shape.dtype = " + to_string(config.shape.dtype) +
                          ": expected float16 (mixkv.cuda's ops take float16 arrays through "
                          "__cuda_array_interface__, which has no bfloat16; a BF16 cache runs on the GPU through "
                          "mixkv.Engine(backend='cuda'), or as a mixkv.KVCache on the CPU)");
  }
  return config;
}

}  // namespace

DeviceKVCache::DeviceKVCache(CacheConfig config)
    : KVCacheManager(fp16_config(config)), device_(current_device()), arena_(config.arena_bytes) {
  if (swap_bytes() > 0) swap_.emplace(swap_layout());
}

void bind_cuda_cache(py::module_& cuda) {
  bind_device_memory(cuda);
  cuda.def("device_available", &gpu::cuda_device_available, "True when the CUDA runtime sees at least one device.");

  py::class_<DeviceKVCache, KVCacheManager>(
      cuda, "DeviceKVCache", init_only(),
      "A KVCacheManager with a device arena (one cudaMalloc on the current device): the cache of the CUDA backend, "
      "which mixkv.ops fill and read with CUDA arrays.")
      .def(py::init<CacheConfig>(), py::arg("config"))
      .def_property_readonly("device", &DeviceKVCache::device, "The CUDA device holding the arena.")
      .def_property_readonly(
          "arena",
          [](py::object self) {
            const auto& cache = self.cast<const DeviceKVCache&>();
            return device_bytes(cache.arena().base(), cache.arena().bytes(), self);
          },
          "The whole arena as device memory (DeviceBytes: __cuda_array_interface__, uint8).")
      .def_property_readonly(
          "swap",
          [](py::object self) -> py::object {
            const gpu::PinnedSwapBuffer* swap = self.cast<const DeviceKVCache&>().swap();
            if (swap == nullptr) return py::none();
            return py::array_t<std::uint8_t>({static_cast<py::ssize_t>(swap->bytes())}, {py::ssize_t{1}},
                                             reinterpret_cast<std::uint8_t*>(swap->host()), self);
          },
          "The host swap pool (swap_bytes() of pinned host memory) as a NumPy uint8 array without a copy, or None "
          "when config.swap_blocks is all 0. Bytes copied by ops.swap_blocks are there once its stream has passed "
          "the copy.")
      .def(
          "check_status",
          [](const DeviceKVCache& cache, py::handle stream) {
            const cudaStream_t s = stream_arg(stream);
            {
              py::gil_scoped_release release;
              MIXKV_CUDA_CHECK(cudaStreamSynchronize(s));
            }
            cache.status().raise_if_set(s);
          },
          py::arg("stream") = py::none(),
          "Synchronizes the stream, then raises IndexError for the first id out of range that a kernel of "
          "ops.append, copy_blocks, demote or swap_blocks met on this cache since the last report (the kernel "
          "skipped that row), naming the op, the argument, the row and the limit. Every op on the cache raises "
          "such a report before it starts too.");

  py::class_<gpu::PageTableConfig>(cuda, "PageTableConfig", init_only(), "Capacity of DevicePageTables.")
      .def(py::init([](std::int32_t num_layers, std::int32_t max_sequences, std::int32_t max_blocks_per_sequence,
                       std::optional<std::array<std::int32_t, kNumPrecisions>> pool_blocks) {
             gpu::PageTableConfig c;
             c.num_layers = num_layers;
             c.max_sequences = max_sequences;
             c.max_blocks_per_sequence = max_blocks_per_sequence;
             if (pool_blocks) c.pool_blocks = *pool_blocks;
             return c;
           }),
           py::arg("num_layers"), py::arg("max_sequences"), py::arg("max_blocks_per_sequence"),
           py::arg("pool_blocks") = py::none())
      .def_readwrite("num_layers", &gpu::PageTableConfig::num_layers)
      .def_readwrite("max_sequences", &gpu::PageTableConfig::max_sequences, "sequence slots (the batch capacity)")
      .def_readwrite("max_blocks_per_sequence", &gpu::PageTableConfig::max_blocks_per_sequence,
                     "per (layer, pool): the longest page list")
      .def_property(
          "pool_blocks",
          [](const gpu::PageTableConfig& c) -> py::object {
            if (!c.bounded()) return py::none();
            return py::cast(std::vector<std::int32_t>(c.pool_blocks.begin(), c.pool_blocks.end()));
          },
          [](gpu::PageTableConfig& c, std::optional<std::array<std::int32_t, kNumPrecisions>> blocks) {
            c.pool_blocks = blocks ? *blocks
                                   : std::array<std::int32_t, kNumPrecisions>{gpu::PageTableConfig::kNoBound,
                                                                              gpu::PageTableConfig::kNoBound,
                                                                              gpu::PageTableConfig::kNoBound};
          },
          "[FP16, INT4, INT2]: block ids below these are accepted (the arena's blocks of each pool), or None "
          "when not given: then DevicePageTables takes them from cache= or from the first sync().");

  py::class_<gpu::DevicePageTables>(
      cuda, "DevicePageTables", init_only(),
      "Device-resident page tables, one padded row per (layer, pool, sequence slot), with a host mirror. Edits "
      "record only what differs from the mirror; upload() sends exactly those, so a step costs O(changes). Block "
      "ids are checked against the pools' sizes (config.pool_blocks, or those of `cache`), so that decode never "
      "reads outside the arena.")
      .def(py::init([](const gpu::PageTableConfig& config, const KVCacheManager* cache) {
             if (cache == nullptr) return std::make_unique<gpu::DevicePageTables>(config);
             return std::make_unique<gpu::DevicePageTables>(config, cache->arena_layout());
           }),
           py::arg("config"), py::arg("cache") = py::none(),
           "With `cache` (a DeviceKVCache), config.pool_blocks is taken from its arena.")
      .def_property_readonly(
          "config", [](const gpu::DevicePageTables& t) { return t.config(); }, "A copy of the configuration.")
      .def(
          "set_blocks",
          [](gpu::DevicePageTables& t, std::int32_t slot, std::int32_t layer, Precision pool, py::handle blocks,
             std::int32_t last_block_len) {
            // A list set by hand must be checked against the arena it will be
            // read from: tables without that bound refuse it.
            if (!t.config().bounded()) {
              throw InvalidArgument(
                  "DevicePageTables.set_blocks: the tables have no pool bound: expected tables made with cache= or "
                  "config.pool_blocks, or a sync() from the cache first");
            }
            const std::vector<std::int32_t> ids = index_vector(blocks, "set_blocks: blocks");
            t.set_blocks(slot, layer, pool, ids, last_block_len);
          },
          py::arg("slot"), py::arg("layer"), py::arg("pool"), py::arg("blocks"), py::arg("last_block_len") = 0,
          "Sets the page list of (slot, layer, pool); last_block_len is the FP16 tail fill (ignored for quantized "
          "pools). Raises IndexError for a block id outside [0, config.pool_blocks[pool]).")
      .def(
          "sync",
          [](gpu::DevicePageTables& t, std::int32_t slot, const KVCacheManager& manager, SequenceId id) {
            const PageTable& table = manager.page_table(id);
            const std::array<std::int32_t, kNumPrecisions> bound = pool_blocks_of(manager.arena_layout());
            if (t.config().pool_blocks != bound) t.set_pool_blocks(bound);
            t.sync(slot, table);
          },
          py::arg("slot"), py::arg("manager"), py::arg("id"),
          "Every (layer, pool) list of sequence `id` of `manager` into `slot`; the tables take the bound of "
          "`manager`'s pools.")
      .def("clear", &gpu::DevicePageTables::clear, py::arg("slot"), "Empties every list of `slot`.")
      .def("pending_updates", &gpu::DevicePageTables::pending_updates, "Entries changed since the last upload.")
      .def(
          "upload", [](gpu::DevicePageTables& t, py::handle stream) { return t.upload(stream_arg(stream)); },
          py::arg("stream") = py::none(),
          "Sends the pending entries on the stream (asynchronous); returns how many were sent.")
      .def("num_blocks", &gpu::DevicePageTables::num_blocks, py::arg("slot"), py::arg("layer"), py::arg("pool"))
      .def("fp16_fill", &gpu::DevicePageTables::fp16_fill, py::arg("slot"), py::arg("layer"))
      .def(
          "blocks",
          [](const gpu::DevicePageTables& t, std::int32_t slot, std::int32_t layer, Precision pool) {
            return int32_array(t.blocks(slot, layer, pool));
          },
          py::arg("slot"), py::arg("layer"), py::arg("pool"), "Host mirror of one list (a copy).");

  py::enum_<gpu::LayerSharing>(cuda, "LayerSharing",
                               "Whether a DecodePlan's layers of equal list lengths share work items.")
      .value("Auto", gpu::LayerSharing::kAuto, "from a batch of as many (sequence, KV head) pairs as SMs")
      .value("Never", gpu::LayerSharing::kNever, "every layer planned on its own")
      .value("Always", gpu::LayerSharing::kAlways, "at any batch");

  py::class_<gpu::DecodePlanConfig>(cuda, "DecodePlanConfig", init_only(), "Shapes and capacity of a DecodePlan.")
      .def(py::init([](std::int32_t num_layers, std::int32_t num_q_heads, std::int32_t num_kv_heads,
                       std::int32_t head_dim, std::int32_t block_size, std::int32_t max_batch,
                       std::int32_t max_items_per_layer, std::int32_t num_sms, std::int32_t chunks_per_sequence,
                       std::int32_t max_heads_per_item, std::int32_t batch_invariant_blocks,
                       gpu::LayerSharing layer_sharing) {
             gpu::DecodePlanConfig c;
             c.num_layers = num_layers;
             c.num_q_heads = num_q_heads;
             c.num_kv_heads = num_kv_heads;
             c.head_dim = head_dim;
             c.block_size = block_size;
             c.max_batch = max_batch;
             c.max_items_per_layer = max_items_per_layer;
             c.num_sms = num_sms;
             c.chunks_per_sequence = chunks_per_sequence;
             c.max_heads_per_item = max_heads_per_item;
             c.batch_invariant_blocks = batch_invariant_blocks;
             c.layer_sharing = layer_sharing;
             return c;
           }),
           py::arg("num_layers"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("block_size"), py::arg("max_batch"), py::arg("max_items_per_layer") = 0, py::arg("num_sms") = 0,
           py::arg("chunks_per_sequence") = 0, py::arg("max_heads_per_item") = 0, py::arg("batch_invariant_blocks") = 0,
           py::arg("layer_sharing") = gpu::LayerSharing::kAuto)
      .def_readwrite("num_layers", &gpu::DecodePlanConfig::num_layers)
      .def_readwrite("num_q_heads", &gpu::DecodePlanConfig::num_q_heads)
      .def_readwrite("num_kv_heads", &gpu::DecodePlanConfig::num_kv_heads)
      .def_readwrite("head_dim", &gpu::DecodePlanConfig::head_dim, "64, 128 or 256 (the built instances)")
      .def_readwrite("block_size", &gpu::DecodePlanConfig::block_size, "16, 32 or 64 (the built instances)")
      .def_readwrite("max_batch", &gpu::DecodePlanConfig::max_batch)
      .def_readwrite("max_items_per_layer", &gpu::DecodePlanConfig::max_items_per_layer,
                     "0: P + 12 * SMs (+ P * chunks_per_sequence when that is set), P = max_batch * "
                     "num_kv_heads * the head tiles")
      .def_readwrite("num_sms", &gpu::DecodePlanConfig::num_sms, "0: those of the current device")
      .def_readwrite("chunks_per_sequence", &gpu::DecodePlanConfig::chunks_per_sequence,
                     "split-KV chunks per (sequence, KV head); 0: chosen from the batch")
      .def_readwrite("max_heads_per_item", &gpu::DecodePlanConfig::max_heads_per_item,
                     "query heads one work item computes at most: 8 or 16 (that instance built); 0: 16 where "
                     "built and max_batch * num_kv_heads >= 16, else 8")
      .def_readwrite("batch_invariant_blocks", &gpu::DecodePlanConfig::batch_invariant_blocks,
                     "> 0: each (sequence, KV head) cut into chunks of that many blocks of its own lists, so its "
                     "output does not depend on the batch; 0: split by the batch")
      .def_readwrite("layer_sharing", &gpu::DecodePlanConfig::layer_sharing,
                     "whether layers of equal list lengths share work items (LayerSharing)");

  py::class_<gpu::DecodePlan>(
      cuda, "DecodePlan", init_only(),
      "Paged decode attention's plan/run split: plan() once per decode step on the host from the tables' host "
      "mirror (uploads the work list asynchronously), then mixkv.ops.paged_decode_attention(cache, plan, layer, "
      "...) per layer: one launch over every pool and split-KV chunk, then one merge.")
      .def(py::init([](const gpu::DecodePlanConfig& config, const gpu::DevicePageTables& tables) {
             auto plan = std::make_unique<gpu::DecodePlan>(config, tables);
             plan_tables()[plan.get()] = &tables;
             return plan;
           }),
           py::arg("config"), py::arg("tables"), py::keep_alive<1, 3>(),
           "Raises ValueError naming the field for a bad shape or one without a built kernel.")
      .def(
          "plan",
          [](gpu::DecodePlan& p, py::handle slots, py::handle stream) {
            const std::vector<std::int32_t> ids = index_vector(slots, "plan: slots");
            // The GIL stays held: plan() reads the tables' host mirror, which
            // another thread's set_blocks or sync could rewrite meanwhile.
            p.plan(ids, stream_arg(stream));
          },
          py::arg("slots"), py::arg("stream") = py::none(),
          "slots[i]: the page-table slot of batch entry i. Raises ValueError for a batch over max_batch or a slot "
          "out of range, MemoryError when a layer needs more work items than its capacity.")
      .def_property_readonly(
          "config", [](const gpu::DecodePlan& p) { return p.config(); }, "A copy of the configuration.")
      .def_property_readonly("batch_size", &gpu::DecodePlan::batch_size)
      .def("num_items", &gpu::DecodePlan::num_items, py::arg("layer"))
      .def("planned_layer", &gpu::DecodePlan::planned_layer, py::arg("layer"),
           "The layer whose work items `layer` runs (itself, or an earlier layer of equal list lengths).")
      .def("num_planned_layers", &gpu::DecodePlan::num_planned_layers, "Distinct sets of work items of the plan.")
      .def("num_split_items", &gpu::DecodePlan::num_split_items, py::arg("layer"))
      .def("bytes_read", &gpu::DecodePlan::bytes_read, py::arg("layer"),
           "Bytes one run of `layer` must read from HBM (codes, parameters, FP16 rows, tables, queries).");

  py::class_<gpu::DeviceStoreMapping>(
      cuda, "DeviceStoreMapping", init_only(),
      "A StoreMapping copied to the device once (validated on the host), for store_prefill. Reusing one object "
      "for every layer on one stream is safe: each upload is ordered after the previous launch.")
      .def(py::init<>())
      .def(
          "upload",
          [](gpu::DeviceStoreMapping& d, const StoreMapping& mapping, std::int32_t block_size, py::handle stream,
             const KVCacheManager* cache) {
            // `mapping` was converted while the GIL is held and is this
            // call's own: nothing can change it between the checks and the copy.
            const cudaStream_t s = stream_arg(stream);
            if (cache == nullptr) {
              d.upload(mapping, block_size, s);
              return;
            }
            if (block_size != cache->config().shape.block_size) {
              throw InvalidArgument("DeviceStoreMapping.upload: block_size = " + std::to_string(block_size) +
                                    ": expected the cache's block_size " +
                                    std::to_string(cache->config().shape.block_size));
            }
            d.upload(mapping, cache->arena_layout(), s);
          },
          py::arg("mapping"), py::arg("block_size"), py::arg("stream") = py::none(), py::arg("cache") = py::none(),
          "Validates and copies `mapping`; with `cache`, also every slot and block id against its pools "
          "(IndexError). ops.store_prefill checks the mapping's largest ids against the cache it stores into "
          "either way.")
      .def_property_readonly("rows", [](const gpu::DeviceStoreMapping& d) {
        gpu::StorePrefillArgs args;
        d.fill(args);
        return args.rows;
      });
}

}  // namespace mixkv::python
