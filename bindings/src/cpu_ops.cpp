// mixkv.ops on the CPU backend: a mixkv.KVCache and NumPy arrays. K/V and
// queries are of the cache's 16-bit type: NumPy float16 (mixkv::Half bit
// for bit) for an FP16 cache, a bfloat16 CPU array through DLPack
// (torch.bfloat16; NumPy has no bfloat16) for a BF16 one; outputs float32. Every
// array is checked (dtype, shape, C-contiguity, writability) before the C++
// call, which then checks the values (slots, NaN) itself. Long calls release
// the GIL, after copying every mapping, page table and copy list they read
// into values of their own while still holding it: another thread may edit
// the Python objects meanwhile without changing what was validated. The K/V
// and query arrays are read in place (copying a prefill would double its
// cost); they stay referenced by the call, and must not be written by
// another thread meanwhile (quant_math.h keeps even that free of undefined
// behaviour: a NaN written after the check codes as 0).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "dlpack.h"
#include "host_arrays.h"
#include "host_kv_cache.h"
#include "mixkv/core/cache_shape.h"
#include "mixkv/core/errors.h"
#include "mixkv/cpu/decode_attention.h"
#include "mixkv/cpu/demote.h"
#include "mixkv/cpu/merge_states.h"
#include "mixkv/cpu/quantize.h"
#include "mixkv/cpu/store.h"
#include "mixkv/cpu/swap.h"

namespace mixkv::python {
namespace {

using std::string;

// K, V or q of the cache's 16-bit type, checked as input_array checks its
// arrays; the object that keeps the values alive stays with it.
struct Input16 {
  py::array array;         // F16: the NumPy array
  BorrowedArray borrowed;  // BF16: the borrowed DLPack tensor
  Span16 values;
  std::vector<std::int64_t> shape;

  std::int64_t dim(int i) const { return shape[static_cast<std::size_t>(i)]; }
};

Input16 input16(DType dtype, py::handle obj, const char* fn, const char* arg, std::initializer_list<Dim> dims) {
  const string where = string(fn) + ": " + arg;
  Input16 in;
  if (dtype == DType::F16) {
    const auto a = input_array<Half>(obj, where, dims);
    in.array = a.array;
    in.values = a.values;
    in.shape.assign(a.array.shape(), a.array.shape() + a.array.ndim());
    return in;
  }
  if (py::isinstance<py::array>(obj)) {
    throw InvalidArgument(where + ": expected a bfloat16 array on cpu (the cache's dtype; NumPy has no bfloat16: " +
                          "torch.bfloat16 tensors cross through DLPack), got a NumPy " +
                          string(py::str(py::reinterpret_borrow<py::array>(obj).dtype())) + " array");
  }
  in.borrowed = borrow_array(obj, fn, arg, ArrayExpect{{dtype}, DeviceKind::CPU, 0, false, 0});
  const TensorView& v = in.borrowed.view();
  in.shape.assign(v.shape.begin(), v.shape.begin() + v.ndim);
  bool match = in.shape.size() == dims.size();
  std::size_t i = 0;
  for (const Dim& d : dims) {
    match = match && (d.size == kAny || d.size == in.shape[i]);
    ++i;
  }
  if (!match) {
    throw InvalidArgument(where + ": expected shape " + dims_text({dims.begin(), dims.size()}) + ", got " +
                          shape_text(std::span<const std::int64_t>(in.shape)));
  }
  in.values = Span16(static_cast<const std::byte*>(v.data), static_cast<std::size_t>(v.numel()), v.dtype);
  return in;
}

void store_prefill(const HostKVCache& cache, py::handle k, py::handle v, const StoreMapping& mapping_object) {
  const StoreMapping mapping = mapping_object;  // the snapshot the call validates and uses
  const CacheShape& s = cache.config().shape;
  const auto rows = static_cast<std::int64_t>(mapping.fp16_slots.size());
  const Input16 kk = input16(s.dtype, k, "store_prefill", "k",
                             {{rows, "rows"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}});
  const Input16 vv = input16(s.dtype, v, "store_prefill", "v",
                             {{rows, "rows"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}});
  const PoolViews pools = cache.pools();
  py::gil_scoped_release release;
  cpu::store_prefill(kk.values, vv.values, mapping, pools);
}

void append(const HostKVCache& cache, py::handle k, py::handle v, py::handle slots) {
  const CacheShape& s = cache.config().shape;
  const std::vector<std::int32_t> fp16_slots = index_vector(slots, "append: slots");
  const auto batch = static_cast<std::int64_t>(fp16_slots.size());
  const Input16 kk = input16(s.dtype, k, "append", "k",
                             {{batch, "batch"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}});
  const Input16 vv = input16(s.dtype, v, "append", "v",
                             {{batch, "batch"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}});
  const PoolView pool = cache.pools()[pool_index(Precision::FP16)];
  py::gil_scoped_release release;
  cpu::append(kk.values, vv.values, fp16_slots, pool);
}

void copy_blocks(const HostKVCache& cache, const std::vector<BlockCopy>& copies, Precision p) {
  const PoolView pool = cache.pools()[pool_index(p)];
  py::gil_scoped_release release;
  cpu::copy_blocks(copies, pool);
}

void demote(const HostKVCache& cache, const std::vector<DemoteOp>& demote_ops) {
  const PoolViews pools = cache.pools();
  py::gil_scoped_release release;
  cpu::demote(demote_ops, pools);
}

void swap_blocks(const HostKVCache& cache, const std::vector<SwapCopy>& copies, SwapDirection direction) {
  const PoolViews device = cache.pools();
  const PoolViews host = cache.swap_pools();
  py::gil_scoped_release release;
  cpu::swap_blocks(copies, direction, device, host);
}

// One layer's tables ([FP16, INT4, INT2], a copy: another thread may assign
// to md.table(...).indices while the GIL is released).
py::tuple decode_layer(const HostKVCache& cache, const std::array<PagedPoolTable, kNumPrecisions>& tables, py::handle q,
                       std::optional<float> sm_scale, py::object out, py::object lse) {
  const CacheShape& s = cache.config().shape;
  if (tables[0].indptr.empty()) {
    throw InvalidArgument("paged_decode_attention: tables[FP16].indptr is empty: expected batch + 1 entries");
  }
  const auto batch = static_cast<std::int64_t>(tables[0].indptr.size()) - 1;
  const Input16 qq = input16(s.dtype, q, "paged_decode_attention", "q",
                             {{batch, "batch"}, {kAny, "num_q_heads"}, {s.head_dim, "head_dim"}});
  const auto q_heads = static_cast<py::ssize_t>(qq.dim(1));
  if (out.is_none()) out = new_float_array({batch, q_heads, s.head_dim});
  if (lse.is_none()) lse = new_float_array({batch, q_heads});
  const auto o = output_array<float>(out, "paged_decode_attention: out",
                                     {{batch, "batch"}, {q_heads, "num_q_heads"}, {s.head_dim, "head_dim"}});
  const auto l = output_array<float>(lse, "paged_decode_attention: lse", {{batch, "batch"}, {q_heads, "num_q_heads"}});
  cpu::DecodeAttentionArgs args;
  args.q = qq.values;
  args.num_q_heads = static_cast<std::int32_t>(q_heads);
  args.sm_scale = sm_scale.value_or(1.0f / std::sqrt(static_cast<float>(s.head_dim)));
  args.tables = &tables;
  args.pools = cache.pools();
  args.out = o.values;
  args.lse = l.values;
  {
    py::gil_scoped_release release;
    cpu::decode_attention(args);
  }
  return py::make_tuple(out, lse);
}

py::tuple paged_decode_attention(const HostKVCache& cache, const DecodeMetadata& metadata, std::int32_t layer,
                                 py::handle q, std::optional<float> sm_scale, py::object out, py::object lse) {
  if (layer < 0 || static_cast<std::size_t>(layer) >= metadata.layers.size()) {
    throw IndexOutOfRange("paged_decode_attention: layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(metadata.layers.size()) + " (metadata.num_layers)");
  }
  const std::array<PagedPoolTable, kNumPrecisions> tables = metadata.layers[static_cast<std::size_t>(layer)];
  return decode_layer(cache, tables, q, sm_scale, std::move(out), std::move(lse));
}

// The tables of one layer as Scheduler.layer_metadata(layer) builds them
// (SchedulerConfig.build_metadata off); `layer` names the layer they are of.
py::tuple paged_decode_attention_layer(const HostKVCache& cache, std::array<PagedPoolTable, kNumPrecisions> tables,
                                       std::int32_t layer, py::handle q, std::optional<float> sm_scale, py::object out,
                                       py::object lse) {
  const std::int32_t layers = cache.config().shape.num_layers;
  if (layer < 0 || layer >= layers) {
    throw IndexOutOfRange("paged_decode_attention: layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(layers) + " (shape.num_layers)");
  }
  return decode_layer(cache, tables, q, sm_scale, std::move(out), std::move(lse));
}

// Shapes (*states, head_dim) and (*states) taken from out_a.
py::tuple merge_states(py::array out_a, py::array lse_a, py::array out_b, py::array lse_b, py::object out,
                       py::object lse) {
  constexpr const char* fn = "merge_states: ";
  if (out_a.ndim() < 1) throw InvalidArgument(string(fn) + "out_a: expected shape (*states, head_dim), got a scalar");
  std::vector<Dim> out_dims;
  std::vector<Dim> lse_dims;
  for (py::ssize_t i = 0; i + 1 < out_a.ndim(); ++i) {
    out_dims.push_back({out_a.shape(i), "states"});
    lse_dims.push_back({out_a.shape(i), "states"});
  }
  out_dims.push_back({out_a.shape(out_a.ndim() - 1), "head_dim"});
  auto input = [&](py::handle a, const char* name, const std::vector<Dim>& dims) {
    const py::array checked = check_host_array(a, string(fn) + name, "float32", dims, false);
    return std::span<const float>(static_cast<const float*>(checked.data()), static_cast<std::size_t>(checked.size()));
  };
  const auto oa = input(out_a, "out_a", out_dims);
  const auto la = input(lse_a, "lse_a", lse_dims);
  const auto ob = input(out_b, "out_b", out_dims);
  const auto lb = input(lse_b, "lse_b", lse_dims);
  if (out.is_none()) out = py::array_t<float>(std::vector<py::ssize_t>(out_a.shape(), out_a.shape() + out_a.ndim()));
  if (lse.is_none())
    lse = py::array_t<float>(std::vector<py::ssize_t>(out_a.shape(), out_a.shape() + out_a.ndim() - 1));
  py::array o = check_host_array(out, string(fn) + "out", "float32", out_dims, true);
  py::array l = check_host_array(lse, string(fn) + "lse", "float32", lse_dims, true);
  const std::span<float> os(static_cast<float*>(o.mutable_data()), static_cast<std::size_t>(o.size()));
  const std::span<float> ls(static_cast<float*>(l.mutable_data()), static_cast<std::size_t>(l.size()));
  const auto head_dim = static_cast<std::int32_t>(out_a.shape(out_a.ndim() - 1));
  {
    py::gil_scoped_release release;
    cpu::merge_states(oa, la, ob, lb, head_dim, os, ls);
  }
  return py::make_tuple(out, lse);
}

py::tuple read_head(const BlockFormat& format, py::handle head_region) {
  validate(CacheShape{1, format.num_kv_heads, format.head_dim, format.block_size, format.dtype});
  const auto bytes = static_cast<std::int64_t>(format.head_bytes());
  const auto region = input_array<std::uint8_t>(head_region, "read_head: head_region", {{bytes, "head_bytes"}});
  py::array_t<float> k({format.block_size, format.head_dim});
  py::array_t<float> v({format.block_size, format.head_dim});
  cpu::read_head(format, reinterpret_cast<const std::byte*>(region.values.data()), k.mutable_data(), v.mutable_data());
  return py::make_tuple(k, v);
}

}  // namespace

void bind_cpu_ops(py::module_& ops) {
  ops.def("store_prefill", &store_prefill, py::arg("cache"), py::arg("k"), py::arg("v"), py::arg("mapping"),
          "Stores one layer's prefill K/V, [rows, num_kv_heads, head_dim] each of the cache's dtype (NumPy "
          "float16, or torch.bfloat16 for a BF16 cache), where `mapping` "
          "(KVCacheManager.prefill_mapping, several appended for a batch) says: FP16 rows to their slots, "
          "INT4/INT2 windows quantized into their blocks.");
  ops.def("append", &append, py::arg("cache"), py::arg("k"), py::arg("v"), py::arg("slots"),
          "Writes one decode token per sequence, [batch, num_kv_heads, head_dim] of the cache's dtype, into the FP16 "
          "slots of "
          "one layer (AppendResult.slots[layer]); a slot of -1 pads the batch (that row is not written).");
  ops.def("copy_blocks", &copy_blocks, py::arg("cache"), py::arg("copies"), py::arg("precision") = Precision::FP16,
          "Copies whole blocks inside one pool (AppendResult.copies, before the step's tokens are written).");
  ops.def("demote", &demote, py::arg("cache"), py::arg("ops"),
          "Requantizes what KVCacheManager.demote returned (list[DemoteOp]): FP16 -> INT4/INT2 gives the codes "
          "store_prefill makes from those FP16 values, INT4 -> INT2 requantizes the INT4-dequantized values.");
  py::native_enum<SwapDirection>(ops, "SwapDirection", "enum.IntEnum", "Direction of ops.swap_blocks.")
      .value("DeviceToHost", SwapDirection::DeviceToHost, "swap_out's copies")
      .value("HostToDevice", SwapDirection::HostToDevice, "swap_in's copies")
      .finalize();
  ops.def("swap_blocks", &swap_blocks, py::arg("cache"), py::arg("copies"), py::arg("direction"),
          "Copies whole blocks between the arena and the host swap pool (KVCache.swap) as swap_out (DeviceToHost) "
          "or swap_in (HostToDevice) listed them.");
  ops.def("paged_decode_attention", &paged_decode_attention, py::arg("cache"), py::arg("metadata"), py::arg("layer"),
          py::arg("q"), py::kw_only(), py::arg("sm_scale") = py::none(), py::arg("out") = py::none(),
          py::arg("lse") = py::none(),
          "Decode attention of one layer over the three pools of every sequence of `metadata`, with GQA. q is "
          "[batch, num_q_heads, head_dim] of the cache's dtype; returns (out float32 [batch, num_q_heads, head_dim], "
          "lse float32 "
          "[batch, num_q_heads]), natural-log LSE, -inf for a sequence without tokens. sm_scale defaults to "
          "1/sqrt(head_dim). Accumulates in float64 on the dequantized K/V: the reference the CUDA kernel is held "
          "to.");
  ops.def("paged_decode_attention", &paged_decode_attention_layer, py::arg("cache"), py::arg("metadata"),
          py::arg("layer"), py::arg("q"), py::kw_only(), py::arg("sm_scale") = py::none(), py::arg("out") = py::none(),
          py::arg("lse") = py::none(),
          "The same over one layer's [FP16, INT4, INT2] tables, as Scheduler.layer_metadata(layer) returns them "
          "(SchedulerConfig.build_metadata off).");
  ops.def("merge_states", &merge_states, py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"),
          py::kw_only(), py::arg("out") = py::none(), py::arg("lse") = py::none(),
          "Merges attention states of the same queries over disjoint keys: out (*states, head_dim) and lse "
          "(*states), float32, natural-log LSE. An empty state (lse -inf) contributes nothing; two empty states "
          "give (0, -inf), never NaN. out/lse may be out_a/lse_a (in place). Returns (out, lse).");
  ops.def("read_head", &read_head, py::arg("format"), py::arg("head_region"),
          "Dequantizes (or widens) one KV head of a block: head_region is uint8 [format.head_bytes] (e.g. a slice "
          "of KVCache.block()); returns (k, v) float32 [block_size, head_dim], the values every decode kernel sees.");
}

}  // namespace mixkv::python
