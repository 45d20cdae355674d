// mixkv.cuda: DeviceKVCache, the device page tables and the decode plan
// (FlashInfer's plan/run split: plan once per step on the host, run per layer
// through mixkv.ops.paged_decode_attention), and DeviceStoreMapping.
#include "cuda_cache.h"

#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "cuda_arrays.h"
#include "host_arrays.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/store.h"

namespace mixkv::python {

DeviceKVCache::DeviceKVCache(CacheConfig config)
    : KVCacheManager(config), device_(current_device()), arena_(config.arena_bytes) {
  if (swap_bytes() > 0) swap_.emplace(swap_layout());
}

void bind_cuda_cache(py::module_& cuda) {
  bind_device_memory(cuda);
  cuda.def("device_available", &gpu::cuda_device_available,
           "True when the CUDA runtime sees at least one device.");

  py::class_<DeviceKVCache, KVCacheManager>(
      cuda, "DeviceKVCache",
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
          "the copy.");

  py::class_<gpu::PageTableConfig>(cuda, "PageTableConfig", "Capacity of DevicePageTables.")
      .def(py::init([](std::int32_t num_layers, std::int32_t max_sequences, std::int32_t max_blocks_per_sequence) {
             return gpu::PageTableConfig{num_layers, max_sequences, max_blocks_per_sequence};
           }),
           py::arg("num_layers"), py::arg("max_sequences"), py::arg("max_blocks_per_sequence"))
      .def_readwrite("num_layers", &gpu::PageTableConfig::num_layers)
      .def_readwrite("max_sequences", &gpu::PageTableConfig::max_sequences, "sequence slots (the batch capacity)")
      .def_readwrite("max_blocks_per_sequence", &gpu::PageTableConfig::max_blocks_per_sequence,
                     "per (layer, pool): the longest page list");

  py::class_<gpu::DevicePageTables>(
      cuda, "DevicePageTables",
      "Device-resident page tables, one padded row per (layer, pool, sequence slot), with a host mirror. Edits "
      "record only what differs from the mirror; upload() sends exactly those, so a step costs O(changes).")
      .def(py::init<const gpu::PageTableConfig&>(), py::arg("config"))
      .def_property_readonly("config", &gpu::DevicePageTables::config)
      .def(
          "set_blocks",
          [](gpu::DevicePageTables& t, std::int32_t slot, std::int32_t layer, Precision pool, py::handle blocks,
             std::int32_t last_block_len) {
            const std::vector<std::int32_t> ids = index_vector(blocks, "set_blocks: blocks");
            t.set_blocks(slot, layer, pool, ids, last_block_len);
          },
          py::arg("slot"), py::arg("layer"), py::arg("pool"), py::arg("blocks"), py::arg("last_block_len") = 0,
          "Sets the page list of (slot, layer, pool); last_block_len is the FP16 tail fill (ignored for quantized "
          "pools).")
      .def(
          "sync",
          [](gpu::DevicePageTables& t, std::int32_t slot, const KVCacheManager& manager, SequenceId id) {
            t.sync(slot, manager.page_table(id));
          },
          py::arg("slot"), py::arg("manager"), py::arg("id"),
          "Every (layer, pool) list of sequence `id` of `manager` into `slot`.")
      .def("clear", &gpu::DevicePageTables::clear, py::arg("slot"), "Empties every list of `slot`.")
      .def("pending_updates", &gpu::DevicePageTables::pending_updates, "Entries changed since the last upload.")
      .def(
          "upload",
          [](gpu::DevicePageTables& t, py::handle stream) { return t.upload(stream_arg(stream)); },
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

  py::class_<gpu::DecodePlanConfig>(cuda, "DecodePlanConfig", "Shapes and capacity of a DecodePlan.")
      .def(py::init([](std::int32_t num_layers, std::int32_t num_q_heads, std::int32_t num_kv_heads,
                       std::int32_t head_dim, std::int32_t block_size, std::int32_t max_batch,
                       std::int32_t max_items_per_layer, std::int32_t num_sms, std::int32_t chunks_per_sequence,
                       std::int32_t max_heads_per_item) {
             return gpu::DecodePlanConfig{num_layers, num_q_heads,         num_kv_heads, head_dim,
                                          block_size, max_batch,           max_items_per_layer,
                                          num_sms,    chunks_per_sequence, max_heads_per_item};
           }),
           py::arg("num_layers"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("block_size"), py::arg("max_batch"), py::arg("max_items_per_layer") = 0, py::arg("num_sms") = 0,
           py::arg("chunks_per_sequence") = 0, py::arg("max_heads_per_item") = 0)
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
                     "built and max_batch * num_kv_heads >= 16, else 8");

  py::class_<gpu::DecodePlan>(
      cuda, "DecodePlan",
      "Paged decode attention's plan/run split: plan() once per decode step on the host from the tables' host "
      "mirror (uploads the work list asynchronously), then mixkv.ops.paged_decode_attention(cache, plan, layer, "
      "...) per layer: one launch over every pool and split-KV chunk, then one merge.")
      .def(py::init<const gpu::DecodePlanConfig&, const gpu::DevicePageTables&>(), py::arg("config"),
           py::arg("tables"), py::keep_alive<1, 3>(),
           "Raises ValueError naming the field for a bad shape or one without a built kernel.")
      .def(
          "plan",
          [](gpu::DecodePlan& p, py::handle slots, py::handle stream) {
            const std::vector<std::int32_t> ids = index_vector(slots, "plan: slots");
            const cudaStream_t s = stream_arg(stream);
            py::gil_scoped_release release;
            p.plan(ids, s);
          },
          py::arg("slots"), py::arg("stream") = py::none(),
          "slots[i]: the page-table slot of batch entry i. Raises ValueError for a batch over max_batch or a slot "
          "out of range, MemoryError when a layer needs more work items than its capacity.")
      .def_property_readonly("config", &gpu::DecodePlan::config)
      .def_property_readonly("batch_size", &gpu::DecodePlan::batch_size)
      .def("num_items", &gpu::DecodePlan::num_items, py::arg("layer"))
      .def("num_split_items", &gpu::DecodePlan::num_split_items, py::arg("layer"))
      .def("bytes_read", &gpu::DecodePlan::bytes_read, py::arg("layer"),
           "Bytes one run of `layer` must read from HBM (codes, parameters, FP16 rows, tables, queries).");

  py::class_<gpu::DeviceStoreMapping>(
      cuda, "DeviceStoreMapping",
      "A StoreMapping copied to the device once (validated on the host), for store_prefill. Reusing one object "
      "for every layer on one stream is safe: each upload is ordered after the previous launch.")
      .def(py::init<>())
      .def(
          "upload",
          [](gpu::DeviceStoreMapping& d, const StoreMapping& mapping, std::int32_t block_size, py::handle stream) {
            d.upload(mapping, block_size, stream_arg(stream));
          },
          py::arg("mapping"), py::arg("block_size"), py::arg("stream") = py::none())
      .def_property_readonly("rows", [](const gpu::DeviceStoreMapping& d) {
        gpu::StorePrefillArgs args;
        d.fill(args);
        return args.rows;
      });
}

}  // namespace mixkv::python
