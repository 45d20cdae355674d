// mixkv.ops on the CUDA backend: a mixkv.cuda.DeviceKVCache and CUDA arrays
// (torch, CuPy) taken in place through __cuda_array_interface__. Every call
// enqueues on the caller's stream (stream_arg) and returns without
// synchronizing; index arrays (slots, copies, moves) are device int32 arrays
// too, so that nothing is copied behind the caller's back.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_arrays.h"
#include "cuda_cache.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/decode_plan.h"
#include "mixkv/kernels/demote.h"
#include "mixkv/kernels/device_page_tables.h"
#include "mixkv/kernels/merge_states.h"
#include "mixkv/kernels/store.h"
#include "mixkv/kernels/swap.h"

namespace mixkv::python {
namespace {

static_assert(sizeof(BlockCopy) == 2 * sizeof(std::int32_t), "BlockCopy crosses as int32 [count, 2]");

// The context of an op on `cache`. An out-of-range id that an earlier op's
// kernel recorded is raised here, before this op does anything: the kernel
// skipped that row, and the caller learns of it at the first op after the
// stream ran it (or at DeviceKVCache.check_status()).
CudaContext context(const DeviceKVCache& cache, py::handle stream) {
  const CudaContext ctx{cache.device(), stream_arg(stream)};
  cache.status().raise_if_set(ctx.stream);
  return ctx;
}

bool bytes_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

void store_prefill(const DeviceKVCache& cache, py::handle k, py::handle v, const gpu::DeviceStoreMapping& mapping,
                   py::handle stream) {
  const CacheShape& s = cache.config().shape;
  const CudaContext ctx = context(cache, stream);
  gpu::StorePrefillArgs args;
  mapping.fill(args);
  const std::initializer_list<Dim> dims = {
      {args.rows, "mapping.rows"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}};
  args.k = cuda_input<Half>(k, "store_prefill: k", dims, ctx);
  args.v = cuda_input<Half>(v, "store_prefill: v", dims, ctx);
  args.pools = cache.pools();
  args.stream = ctx.stream;
  // The mapping's largest ids are checked against this cache's pools here.
  gpu::store_prefill(args);
}

void append(const DeviceKVCache& cache, py::handle k, py::handle v, py::handle slots, py::handle stream) {
  const CacheShape& s = cache.config().shape;
  const CudaContext ctx = context(cache, stream);
  std::vector<py::ssize_t> shape;
  gpu::AppendArgs args;
  args.fp16_slots = cuda_input<std::int32_t>(slots, "append: slots", {{kAny, "batch"}}, ctx, &shape);
  args.batch = static_cast<std::int32_t>(shape[0]);
  const std::initializer_list<Dim> dims = {
      {args.batch, "batch"}, {s.num_kv_heads, "num_kv_heads"}, {s.head_dim, "head_dim"}};
  args.k = cuda_input<Half>(k, "append: k", dims, ctx);
  args.v = cuda_input<Half>(v, "append: v", dims, ctx);
  args.fp16_pool = cache.pools()[pool_index(Precision::FP16)];
  args.stream = ctx.stream;
  args.status = &cache.status();
  gpu::append(args);
}

void copy_blocks(const DeviceKVCache& cache, py::handle copies, Precision p, py::handle stream) {
  const CudaContext ctx = context(cache, stream);
  std::vector<py::ssize_t> shape;
  gpu::CopyBlocksArgs args;
  args.copies = reinterpret_cast<const BlockCopy*>(
      cuda_input<std::int32_t>(copies, "copy_blocks: copies", {{kAny, "count"}, {2, "src_dst"}}, ctx, &shape));
  args.count = static_cast<std::int32_t>(shape[0]);
  args.pool = cache.pools()[pool_index(p)];
  args.stream = ctx.stream;
  args.status = &cache.status();
  gpu::copy_blocks(args);
}

void demote(const DeviceKVCache& cache, py::handle moves, Precision src, Precision dst, py::handle stream) {
  const CudaContext ctx = context(cache, stream);
  std::vector<py::ssize_t> shape;
  gpu::DemoteArgs args;
  args.moves = reinterpret_cast<const BlockCopy*>(
      cuda_input<std::int32_t>(moves, "demote: moves", {{kAny, "count"}, {2, "src_dst"}}, ctx, &shape));
  args.count = static_cast<std::int32_t>(shape[0]);
  const gpu::DevicePools pools = cache.pools();
  args.src_pool = pools[pool_index(src)];
  args.dst_pool = pools[pool_index(dst)];
  args.stream = ctx.stream;
  args.status = &cache.status();
  gpu::demote(args);
}

// The tables a plan reads must not accept ids past this cache's pools (they
// were bounded by the cache they were built from: cache= or sync()).
void check_tables_bound(const DeviceKVCache& cache, const gpu::DecodePlan& plan) {
  const gpu::DevicePageTables* tables = tables_of(plan);
  if (tables == nullptr || !tables->config().bounded()) return;  // unbounded tables hold no ids (set_blocks refuses)
  const PoolLayout layout = cache.arena_layout();
  for (const Precision p : kAllPrecisions) {
    const std::int32_t bound = tables->config().pool_blocks[pool_index(p)];
    const std::int32_t blocks = layout.pools[pool_index(p)].num_blocks;
    if (bound > blocks) {
      throw IndexOutOfRange("paged_decode_attention: plan's tables accept " + std::string(to_string(p)) +
                            " block ids below " + std::to_string(bound) + ": expected at most the cache's " +
                            std::to_string(blocks) + " blocks of that pool (tables bound to another cache?)");
    }
  }
}

py::tuple paged_decode_attention(const DeviceKVCache& cache, const gpu::DecodePlan& plan, std::int32_t layer,
                                 py::handle q, py::object out, py::object lse, std::optional<float> sm_scale,
                                 bool fixed_grid, py::handle stream) {
  const gpu::DecodePlanConfig& c = plan.config();
  const CacheShape& s = cache.config().shape;
  if (c.num_kv_heads != s.num_kv_heads || c.head_dim != s.head_dim || c.block_size != s.block_size ||
      c.num_layers != s.num_layers) {
    throw InvalidArgument("paged_decode_attention: plan.config: expected the cache's num_layers (" +
                          std::to_string(s.num_layers) + "), num_kv_heads (" + std::to_string(s.num_kv_heads) +
                          "), head_dim (" + std::to_string(s.head_dim) + ") and block_size (" +
                          std::to_string(s.block_size) + ")");
  }
  if (layer < 0 || layer >= c.num_layers) {
    throw IndexOutOfRange("paged_decode_attention: layer = " + std::to_string(layer) + ", expected 0 <= layer < " +
                          std::to_string(c.num_layers));
  }
  check_tables_bound(cache, plan);
  const CudaContext ctx = context(cache, stream);
  const std::int64_t batch = plan.batch_size();
  gpu::DecodeRunArgs args;
  args.layer = layer;
  args.q =
      cuda_input<Half>(q, "paged_decode_attention: q",
                       {{batch, "plan.batch_size"}, {c.num_q_heads, "num_q_heads"}, {c.head_dim, "head_dim"}}, ctx);
  args.out =
      cuda_output<Half>(out, "paged_decode_attention: out",
                        {{batch, "plan.batch_size"}, {c.num_q_heads, "num_q_heads"}, {c.head_dim, "head_dim"}}, ctx);
  if (!lse.is_none()) {
    args.lse = cuda_output<float>(lse, "paged_decode_attention: lse",
                                  {{batch, "plan.batch_size"}, {c.num_q_heads, "num_q_heads"}}, ctx);
  }
  // The kernel writes out and lse from different CTAs and reads q while
  // others write: shared bytes would give wrong values (merge_states rejects
  // the same).
  const std::size_t rows = static_cast<std::size_t>(batch) * c.num_q_heads;
  if (args.lse != nullptr) {
    if (bytes_overlap(args.out, rows * c.head_dim * sizeof(Half), args.lse, rows * sizeof(float))) {
      throw InvalidArgument("paged_decode_attention: out overlaps lse: expected disjoint memory");
    }
    if (bytes_overlap(args.q, rows * c.head_dim * sizeof(Half), args.lse, rows * sizeof(float))) {
      throw InvalidArgument("paged_decode_attention: lse overlaps q: expected disjoint memory");
    }
  }
  args.sm_scale = sm_scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  args.pools = cache.pools();
  args.stream = ctx.stream;
  args.fixed_grid = fixed_grid;
  plan.run(args);
  return py::make_tuple(out, lse);
}

void swap_blocks(DeviceKVCache& cache, const std::vector<SwapCopy>& copies, SwapDirection direction,
                 py::handle stream) {
  if (cache.swap() == nullptr) {
    throw InvalidArgument("swap_blocks: cache: expected a DeviceKVCache with a host swap pool (config.swap_blocks)");
  }
  const CudaContext ctx = context(cache, stream);
  gpu::DeviceSwapList& list = cache.swap_list();
  list.upload(copies, direction, cache.arena_layout(), cache.swap_layout(), ctx.stream);
  gpu::SwapBlocksArgs args;
  list.fill(args);
  args.device = cache.pools();
  args.host = cache.swap()->device_views(cache.swap_layout());
  args.stream = ctx.stream;
  args.status = &cache.status();
  gpu::swap_blocks(args);
}

// CUDA arrays have no allocator here: out and lse are the caller's (out_a and
// lse_a for an in-place merge).
py::tuple merge_states(py::object out_a, py::object lse_a, py::object out_b, py::object lse_b, py::object out,
                       py::object lse, py::handle stream) {
  const CudaContext ctx{current_device(), stream_arg(stream)};
  const char* const f32[] = {"<f4"};
  // out_a fixes the shapes: (*states, head_dim) and (*states).
  const std::vector<py::ssize_t> shape = cuda_array_shape(out_a, "merge_states: out_a", "float32");
  if (shape.empty()) throw InvalidArgument("merge_states: out_a: expected shape (*states, head_dim), got ()");
  std::vector<Dim> out_dims;
  std::vector<Dim> lse_dims;
  std::int64_t states = 1;
  for (std::size_t i = 0; i + 1 < shape.size(); ++i) {
    out_dims.push_back({shape[i], "states"});
    lse_dims.push_back({shape[i], "states"});
    states *= shape[i];
  }
  out_dims.push_back({shape.back(), "head_dim"});
  gpu::MergeStatesArgs args;
  if (out.is_none() || lse.is_none()) {
    throw InvalidArgument(
        "merge_states: out, lse: expected CUDA float32 arrays for CUDA inputs (out_a, lse_a merge in "
        "place)");
  }
  auto input = [&](py::handle a, const char* name, const std::vector<Dim>& dims) {
    return static_cast<const float*>(
        check_cuda_array(a, std::string("merge_states: ") + name, f32, "float32", dims, 16, false, ctx).data);
  };
  args.out_a = input(out_a, "out_a", out_dims);
  auto input_lse = [&](py::handle a, const char* name) {
    return static_cast<const float*>(
        check_cuda_array(a, std::string("merge_states: ") + name, f32, "float32", lse_dims, 4, false, ctx).data);
  };
  args.lse_a = input_lse(lse_a, "lse_a");
  args.out_b = input(out_b, "out_b", out_dims);
  args.lse_b = input_lse(lse_b, "lse_b");
  args.out =
      static_cast<float*>(check_cuda_array(out, "merge_states: out", f32, "float32", out_dims, 16, true, ctx).data);
  args.lse =
      static_cast<float*>(check_cuda_array(lse, "merge_states: lse", f32, "float32", lse_dims, 4, true, ctx).data);
  args.num_states = static_cast<std::int32_t>(states);
  args.head_dim = static_cast<std::int32_t>(shape.back());
  args.stream = ctx.stream;
  gpu::merge_states(args);
  return py::make_tuple(out, lse);
}

}  // namespace

void bind_cuda_ops(py::module_& ops) {
  ops.def("store_prefill", &store_prefill, py::arg("cache"), py::arg("k"), py::arg("v"), py::arg("mapping"),
          py::kw_only(), py::arg("stream") = py::none(),
          "CUDA: one layer's prefill K/V, float16 CUDA arrays [mapping.rows, num_kv_heads, head_dim], in one "
          "launch (FP16 rows copied, INT4/INT2 windows quantized and packed, bit-identical to the CPU backend). "
          "`mapping` is a mixkv.cuda.DeviceStoreMapping uploaded for this layer.");
  ops.def("append", &append, py::arg("cache"), py::arg("k"), py::arg("v"), py::arg("slots"), py::kw_only(),
          py::arg("stream") = py::none(),
          "CUDA: one decode token per sequence, float16 [batch, num_kv_heads, head_dim], into FP16 slots given as "
          "a CUDA int32 array [batch] (a row of AppendResult.slots moved to the device); a slot of -1 pads the batch "
          "(that row is not written: a graph captured at a larger batch than the step's). A slot outside the FP16 pool "
          "is skipped on the device and raised as IndexError by the next op on the cache or by "
          "DeviceKVCache.check_status().");
  ops.def("copy_blocks", &copy_blocks, py::arg("cache"), py::arg("copies"), py::arg("precision") = Precision::FP16,
          py::kw_only(), py::arg("stream") = py::none(),
          "CUDA: whole-block copies inside the FP16 pool; copies is a CUDA int32 array [count, 2] of (src, dst). A "
          "copy with an id outside the pool is skipped on the device and raised as IndexError by the next op on "
          "the cache or by DeviceKVCache.check_status().");
  ops.def("demote", &demote, py::arg("cache"), py::arg("moves"), py::arg("src"), py::arg("dst"), py::kw_only(),
          py::arg("stream") = py::none(),
          "CUDA: requantizes blocks into a lower precision, (src, dst) one of (FP16, INT4), (FP16, INT2), (INT4, "
          "INT2); moves is a CUDA int32 array [count, 2] of (src block id, dst block id). Meant for a stream of its "
          "own so that decode is not stalled. A move with an id outside its pool is skipped on the device and raised "
          "as IndexError by the next op on the cache or by DeviceKVCache.check_status().");
  ops.def("swap_blocks", &swap_blocks, py::arg("cache"), py::arg("copies"), py::arg("direction"), py::kw_only(),
          py::arg("stream") = py::none(),
          "CUDA: copies whole blocks between the device arena and the cache's pinned host swap pool "
          "(DeviceKVCache.swap) as swap_out (DeviceToHost) or swap_in (HostToDevice) listed them, in one launch on "
          "the caller's stream. The list is checked first (pools, block ids, host slots, one writer per "
          "destination); nothing is copied when it is rejected.");
  ops.def("paged_decode_attention", &paged_decode_attention, py::arg("cache"), py::arg("plan"), py::arg("layer"),
          py::arg("q"), py::kw_only(), py::arg("out"), py::arg("lse") = py::none(), py::arg("sm_scale") = py::none(),
          py::arg("fixed_grid") = false, py::arg("stream") = py::none(),
          "CUDA: decode attention of one layer for the batch planned by `plan` (a mixkv.cuda.DecodePlan): q and out "
          "float16 CUDA [batch, num_q_heads, head_dim], lse optional float32 [batch, num_q_heads] (natural log). "
          "fixed_grid sizes the launch for the plan's capacity so a captured CUDA graph survives re-plans. "
          "Returns (out, lse). Raises ValueError when out and lse overlap, IndexError when the plan's tables "
          "accept ids past this cache's pools.");
  ops.def("merge_states", &merge_states, py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"),
          py::kw_only(), py::arg("out") = py::none(), py::arg("lse") = py::none(), py::arg("stream") = py::none(),
          "CUDA: the same merge on float32 CUDA arrays; out and lse are required (pass out_a, lse_a to merge in "
          "place).");
}

}  // namespace mixkv::python
