// KVCacheManager and the values it hands out: StoreMapping, AppendResult,
// DecodeMetadata. Index vectors cross as NumPy int32 arrays (copies), the
// shape engines upload them in.
//
// No call here releases the GIL: the manager is not thread-safe, and the GIL
// is what serializes Python threads that share one.
#include <string>
#include <vector>

#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "host_arrays.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/errors.h"

namespace mixkv::python {
namespace {

std::string window_slot_repr(const WindowSlot& w) {
  return "WindowSlot(block_id=" + std::to_string(w.block_id) + ", first_row=" + std::to_string(w.first_row) + ")";
}

// [layer][row] slots of AppendResult as one [num_layers, rows] array.
py::array_t<std::int32_t> slots_array(const std::vector<std::vector<std::int32_t>>& slots) {
  const py::ssize_t layers = static_cast<py::ssize_t>(slots.size());
  const py::ssize_t batch = slots.empty() ? 0 : static_cast<py::ssize_t>(slots.front().size());
  py::array_t<std::int32_t> a({layers, batch});
  auto view = a.mutable_unchecked<2>();
  for (py::ssize_t l = 0; l < layers; ++l) {
    for (py::ssize_t i = 0; i < batch; ++i) view(l, i) = slots[l][i];
  }
  return a;
}

PagedPoolTable& metadata_table(DecodeMetadata& md, std::int32_t layer, Precision p) {
  if (layer < 0 || static_cast<std::size_t>(layer) >= md.layers.size()) {
    throw IndexOutOfRange("layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(md.layers.size()));
  }
  return md.layers[layer][pool_index(p)];
}

}  // namespace

void bind_kv_cache_manager(py::module_& m) {
  py::class_<WindowSlot>(m, "WindowSlot", init_only(),
                         "One quantized window to store: its block and the row of its first token.")
      .def(py::init([](std::int32_t block_id, std::int32_t first_row) {
             return WindowSlot{block_id, first_row};
           }),
           py::arg("block_id"), py::arg("first_row"))
      .def_readwrite("block_id", &WindowSlot::block_id)
      .def_readwrite("first_row", &WindowSlot::first_row)
      .def(
          "__eq__",
          [](const WindowSlot& a, const WindowSlot& b) {
            return a.block_id == b.block_id && a.first_row == b.first_row;
          },
          py::is_operator())
      .def("__repr__", &window_slot_repr);

  py::class_<StoreMapping>(m, "StoreMapping", init_only(),
                           "Where each K/V row of a prefill goes in one layer: an FP16 slot per row (block_id * "
                           "block_size + offset, or -1 for a row of a quantized window) and one block per "
                           "INT4/INT2 window.")
      .def(py::init<>())
      .def_property(
          "fp16_slots", [](const StoreMapping& s) { return int32_array(s.fp16_slots); },
          [](StoreMapping& s, py::handle v) { s.fp16_slots = index_vector(v, "StoreMapping.fp16_slots"); },
          "int32 array [rows] (a copy; assign to change it).")
      .def_readwrite("int4_windows", &StoreMapping::int4_windows, "list[WindowSlot] (a copy; assign to change it).")
      .def_readwrite("int2_windows", &StoreMapping::int2_windows, "list[WindowSlot] (a copy; assign to change it).")
      .def_property_readonly("num_rows", [](const StoreMapping& s) { return s.fp16_slots.size(); })
      .def("append", &StoreMapping::append, py::arg("other"),
           "Appends `other`, whose rows follow this mapping's rows (several sequences in one store_prefill).")
      .def("__repr__", [](const StoreMapping& s) {
        return "StoreMapping(rows=" + std::to_string(s.fp16_slots.size()) +
               ", int4_windows=" + std::to_string(s.int4_windows.size()) +
               ", int2_windows=" + std::to_string(s.int2_windows.size()) + ")";
      });

  py::class_<BlockCopy>(m, "BlockCopy", init_only(), "A whole-block copy inside one pool (copy-on-write after fork).")
      .def(py::init([](std::int32_t src, std::int32_t dst) {
             return BlockCopy{src, dst};
           }),
           py::arg("src"), py::arg("dst"))
      .def_readwrite("src", &BlockCopy::src)
      .def_readwrite("dst", &BlockCopy::dst)
      .def(
          "__eq__", [](const BlockCopy& a, const BlockCopy& b) { return a.src == b.src && a.dst == b.dst; },
          py::is_operator())
      .def("__repr__", [](const BlockCopy& c) {
        return "BlockCopy(src=" + std::to_string(c.src) + ", dst=" + std::to_string(c.dst) + ")";
      });

  py::class_<SwapCopy>(m, "SwapCopy", init_only(),
                       "One block moved between a device pool and the host swap pool (swap_out / swap_in).")
      .def(py::init([](Precision pool, std::int32_t device_block, std::int32_t host_slot) {
             return SwapCopy{pool, device_block, host_slot};
           }),
           py::arg("pool"), py::arg("device_block"), py::arg("host_slot"))
      .def_readwrite("pool", &SwapCopy::pool)
      .def_readwrite("device_block", &SwapCopy::device_block)
      .def_readwrite("host_slot", &SwapCopy::host_slot)
      .def("__repr__", [](const SwapCopy& c) {
        return "SwapCopy(pool=" + std::string(to_string(c.pool)) + ", device_block=" + std::to_string(c.device_block) +
               ", host_slot=" + std::to_string(c.host_slot) + ")";
      });

  py::class_<Demotion>(m, "Demotion", init_only(), "One window of one layer to move to a lower precision (demote()).")
      .def(py::init([](SequenceId id, std::int32_t layer, std::int32_t window, Precision target, bool leave_shared) {
             return Demotion{
                 .id = id, .layer = layer, .window = window, .target = target, .leave_shared = leave_shared};
           }),
           py::arg("id"), py::arg("layer"), py::arg("window"), py::arg("target") = Precision::INT4,
           py::arg("leave_shared") = false)
      .def_readwrite("id", &Demotion::id)
      .def_readwrite("layer", &Demotion::layer)
      .def_readwrite("window", &Demotion::window, "1 .. num_windows - 1 (window 0 always stays FP16)")
      .def_readwrite("target", &Demotion::target)
      .def_readwrite("leave_shared", &Demotion::leave_shared,
                     "False: the window's block must be this sequence's alone (the demotion frees it). True: other "
                     "sequences may share it; this one moves to its own copy and they keep the original.");

  py::class_<DemoteOp>(m, "DemoteOp", init_only(),
                       "The requantization one Demotion asks of ops.demote: src_block of the src pool into "
                       "dst_block of the dst pool (the manager has already moved the window).")
      .def_readonly("id", &DemoteOp::id)
      .def_readonly("layer", &DemoteOp::layer)
      .def_readonly("window", &DemoteOp::window)
      .def_readonly("src_precision", &DemoteOp::src_precision)
      .def_readonly("src_block", &DemoteOp::src_block)
      .def_readonly("dst_precision", &DemoteOp::dst_precision)
      .def_readonly("dst_block", &DemoteOp::dst_block)
      .def("__repr__", [](const DemoteOp& d) {
        return "DemoteOp(id=" + std::to_string(d.id) + ", layer=" + std::to_string(d.layer) +
               ", window=" + std::to_string(d.window) + ", " + std::string(to_string(d.src_precision)) + " " +
               std::to_string(d.src_block) + " -> " + std::string(to_string(d.dst_precision)) + " " +
               std::to_string(d.dst_block) + ")";
      });

  py::native_enum<AppendSlots>(m, "AppendSlots", "enum.IntEnum", "What append_tokens() returns for the slots.")
      .value("PerLayer", AppendSlots::PerLayer, "AppendResult.slots [num_layers, batch], and the compact form")
      .value("Compact", AppendSlots::Compact, "the compact form only: O(batch) outside block boundaries")
      .finalize();

  py::class_<AppendResult>(m, "AppendResult", init_only(), "What append_tokens() allocated for the new decode tokens.")
      .def_property_readonly(
          "slots", [](const AppendResult& r) { return slots_array(r.slots); },
          "int32 array [num_layers, rows]: FP16 slot of each new token in each layer, rows = batch (one token "
          "a sequence) or sum(counts) (empty with AppendSlots.Compact).")
      .def_property_readonly(
          "offsets", [](const AppendResult& r) { return int32_array(r.offsets); },
          "int32 [batch]: the (first) new token's offset in its FP16 tail block, the same in every layer (compact "
          "form: slot = tail * block_size + offset).")
      .def_property_readonly(
          "tails_changed", [](const AppendResult& r) { return int32_array(r.tails_changed); },
          "int32: batch indices whose tail block changed in some layer (new block or copy-on-write).")
      .def_property_readonly(
          "tail_blocks", [](const AppendResult& r) { return int32_array(r.tail_blocks); },
          "int32 [len(tails_changed) * num_layers]: their tails after the call, tail_blocks[k * num_layers + "
          "layer].")
      .def_readonly("copies", &AppendResult::copies,
                    "list[BlockCopy]: shared, partly filled FP16 tails to copy (ops.copy_blocks) before the "
                    "new tokens are written.");

  py::class_<PagedPoolTable>(m, "PagedPoolTable", init_only(),
                             "The page lists of a batch for one (layer, pool) in CSR form (FlashInfer's paged_kv_t).")
      .def(py::init<>())
      .def_property(
          "indptr", [](const PagedPoolTable& t) { return int32_array(t.indptr); },
          [](PagedPoolTable& t, py::handle v) { t.indptr = index_vector(v, "PagedPoolTable.indptr"); },
          "int32 [batch + 1]")
      .def_property(
          "indices", [](const PagedPoolTable& t) { return int32_array(t.indices); },
          [](PagedPoolTable& t, py::handle v) { t.indices = index_vector(v, "PagedPoolTable.indices"); },
          "int32 block ids; indptr[i]..indptr[i+1] are sequence i's")
      .def_property(
          "last_block_len", [](const PagedPoolTable& t) { return int32_array(t.last_block_len); },
          [](PagedPoolTable& t, py::handle v) { t.last_block_len = index_vector(v, "PagedPoolTable.last_block_len"); },
          "int32 [batch]: valid tokens in each sequence's last block (0 if it has none)");

  py::class_<DecodeMetadata>(m, "DecodeMetadata", init_only(), "Page tables of a decode batch, per layer and pool.")
      .def_readonly("batch_size", &DecodeMetadata::batch_size)
      .def_property_readonly("num_layers", [](const DecodeMetadata& md) { return md.layers.size(); })
      .def("table", &metadata_table, py::arg("layer"), py::arg("precision"),
           py::return_value_policy::reference_internal,
           "The table of (layer, pool), by reference: assigning its fields changes this metadata.");

  py::class_<KVCacheManager>(m, "KVCacheManager", init_only(),
                             "The bookkeeping of a KV cache: arena slabs, the three pools, every sequence's page "
                             "tables. It never touches KV bytes (mixkv.KVCache adds host memory for them). Every "
                             "call validates its input and raises naming the argument; a call that raises changes "
                             "nothing.")
      .def(py::init<CacheConfig>(), py::arg("config"))
      .def_property_readonly(
          "config", [](const KVCacheManager& self) -> CacheConfig { return self.config(); },
          "A copy: editing it changes nothing here (configure a new object with it).")
      .def_property_readonly("total_slabs", &KVCacheManager::total_slabs)
      .def_property_readonly("free_slabs", &KVCacheManager::free_slabs)
      .def("format", &KVCacheManager::format, py::arg("precision"))
      .def("pool_stats", &KVCacheManager::pool_stats, py::arg("precision"))
      .def("prefix_stats", &KVCacheManager::prefix_stats, "The prefix index's blocks and counters.")
      .def("evict_prefix_cache", &KVCacheManager::evict_prefix_cache,
           "Drops every cached block no sequence holds; returns the blocks evicted.")
      .def("demand", &KVCacheManager::demand, py::arg("layout"), py::arg("plan"),
           "Blocks the prompt needs per pool over all layers: [FP16, INT4, INT2].")
      .def("can_allocate", py::overload_cast<const BlockCounts&>(&KVCacheManager::can_allocate, py::const_),
           py::arg("blocks"),
           "Whether [FP16, INT4, INT2] more blocks could be allocated now, counting free slabs and empty slabs "
           "other pools could give back.")
      .def("add_sequence",
           py::overload_cast<SequenceId, const TokenLayout&, const PrecisionPlan&>(&KVCacheManager::add_sequence),
           py::arg("id"), py::arg("layout"), py::arg("plan"),
           "Registers a sequence and allocates its whole prompt under `plan`. MemoryError leaves nothing "
           "allocated; an id already present raises ValueError.")
      .def("contains", &KVCacheManager::contains, py::arg("id"))
      .def("__contains__", &KVCacheManager::contains, py::arg("id"))
      .def("sequence_ids", &KVCacheManager::sequence_ids, "Ascending.")
      .def("num_tokens", &KVCacheManager::num_tokens, py::arg("id"), "Prompt + appended tokens.")
      .def("layout", &KVCacheManager::layout, py::arg("id"))
      .def("plan", &KVCacheManager::plan, py::arg("id"))
      .def("prefill_mapping", &KVCacheManager::prefill_mapping, py::arg("id"), py::arg("layer"),
           "Where the prompt rows of `id` go in `layer`.")
      .def(
          "append_tokens",
          [](KVCacheManager& mgr, const std::vector<SequenceId>& ids, AppendSlots form) {
            return mgr.append_tokens(ids, form);
          },
          py::arg("ids"), py::arg("form") = AppendSlots::PerLayer,
          "One decode token for each sequence (distinct ids), FP16 in every layer. All or nothing: "
          "MemoryError leaves every sequence as it was.")
      .def(
          "append_tokens",
          [](KVCacheManager& mgr, const std::vector<SequenceId>& ids, py::handle counts, AppendSlots form) {
            return mgr.append_tokens(ids, index_vector(counts, "append_tokens: counts"), form);
          },
          py::arg("ids"), py::arg("counts"), py::arg("form") = AppendSlots::PerLayer,
          "Speculative decoding: counts[i] >= 1 tokens for sequence i (an int32 array or a sequence of ints, one "
          "per id), FP16 in every layer, all or nothing. Sequence i's tokens are rows r_i = counts[0] + ... + "
          "counts[i - 1] onwards of slots[layer] (FlashInfer's qo_indptr); offsets[i] is the offset of its first "
          "token in its block. With every count 1 the result equals the one-token call's.")
      .def(
          "truncate", [](KVCacheManager& mgr, SequenceId id, std::int32_t num_tokens) { mgr.truncate(id, num_tokens); },
          py::arg("id"), py::arg("num_tokens"),
          "Drops the last tokens of `id` so that it holds num_tokens (the rejected drafts of a verification step). "
          "Only appended tokens can go: ValueError naming num_tokens below the prompt's length or above "
          "num_tokens(id), or for a swapped-out id. FP16 blocks left empty are released in the reverse of the "
          "order append_tokens took them.")
      .def(
          "truncate",
          [](KVCacheManager& mgr, const std::vector<SequenceId>& ids, py::handle num_tokens) {
            mgr.truncate(ids, index_vector(num_tokens, "truncate: num_tokens"));
          },
          py::arg("ids"), py::arg("num_tokens"),
          "The same for several sequences at once (num_tokens: an int32 array or a sequence of ints, one per id), "
          "all or nothing; errors name ids[i] or num_tokens[i].")
      .def("fork", &KVCacheManager::fork, py::arg("parent"), py::arg("child"),
           "`child` shares every block of `parent`; the partly filled FP16 tail is copied on the first append.")
      .def("free_sequence", &KVCacheManager::free_sequence, py::arg("id"))
      .def(
          "blocks",
          [](const KVCacheManager& mgr, SequenceId id, std::int32_t layer, Precision p) {
            return int32_array(mgr.blocks(id, layer, p));
          },
          py::arg("id"), py::arg("layer"), py::arg("precision"), "Block ids of (sequence, layer, pool) in order.")
      .def("fp16_tail_fill", &KVCacheManager::fp16_tail_fill, py::arg("id"), py::arg("layer"))
      .def("ref_count", &KVCacheManager::ref_count, py::arg("precision"), py::arg("block_id"))
      .def(
          "decode_metadata",
          [](const KVCacheManager& mgr, const std::vector<SequenceId>& ids) { return mgr.decode_metadata(ids); },
          py::arg("ids"), "Page tables of a decode batch (sequences in the order given) for every layer and pool.")
      .def("blocks_held", &KVCacheManager::blocks_held, py::arg("id"),
           "Blocks the sequence holds per pool [FP16, INT4, INT2] (host slots while swapped out).")
      .def("free_swap_slots", &KVCacheManager::free_swap_slots)
      .def("swap_bytes", &KVCacheManager::swap_bytes,
           "Bytes of the host swap buffer: the three pools' slots, FP16 first.")
      .def("is_swapped", &KVCacheManager::is_swapped, py::arg("id"))
      .def("swap_out", &KVCacheManager::swap_out, py::arg("id"),
           "Moves every block of `id` to the host swap pool; returns the copies to make (device -> host, "
           "ops.swap_blocks) before the released device blocks are reused.")
      .def("swap_in", &KVCacheManager::swap_in, py::arg("id"),
           "Brings `id` back into fresh device blocks; returns the copies to make (host -> device). All or "
           "nothing: MemoryError when the device pools lack blocks.")
      .def("why_not_demotable", &KVCacheManager::why_not_demotable, py::arg("id"), py::arg("layer"), py::arg("window"),
           py::arg("target"), py::arg("leave_shared") = false,
           "None when (id, layer, window) could move down to `target` now, else the reason.")
      .def(
          "demote", [](KVCacheManager& mgr, const std::vector<Demotion>& demotions) { return mgr.demote(demotions); },
          py::arg("demotions"),
          "Moves every listed window to a block of its target pool (page table and plan) and releases the "
          "source; returns the DemoteOp list that ops.demote performs. All or nothing.")
      .def("check_invariants", &KVCacheManager::check_invariants,
           "Raises mixkv.InvariantViolation (a RuntimeError) describing the first broken invariant.")
      .def("describe_state", &KVCacheManager::describe_state,
           "Canonical text of all bookkeeping: equal texts mean equal states.");
}

}  // namespace mixkv::python
