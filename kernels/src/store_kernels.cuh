#pragma once
// The store_prefill kernels and their one dispatch point, templates over
// the cache's 16-bit type E (elem16.cuh). store.cu runs them; the FP16
// instances are compiled there, the BF16 ones in store_bf16.cu (each TU
// its own compile job).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_math.cuh"
#include "device_pool.cuh"
#include "fast_divisor.cuh"
#include "mixkv/core/op_types.h"
#include "mixkv/kernels/store.h"
#include "quantize.cuh"
#include "quantize_warp.cuh"

namespace mixkv::gpu::store_kernels {

using detail::DevicePool;
using detail::FastDivisor;

constexpr int kThreads = 128;
// K/V chunk pairs (16 bytes of K and the V at the same place) a lane of a
// copy unit loads before it stores any: 4 KB a warp in flight, as a
// quantizing unit has.
constexpr int kCopyPairs = 4;
// Caps both store kernels at 64 registers: 8 CTAs (32 warps) per SM for
// the units kernel and FP16-only plans (no dynamic shared memory); with two
// tile stages (36 KB at D 128, S 32) shared memory allows store_prefill_kernel
// 6 anyway. Without the cap a CTA-wide FP16 copy takes 95 registers for
// its loads in flight, and more CTAs than 8 buy nothing.
constexpr int kMinCtasPerSm = 8;

// Tile buffers in shared memory: two where they fit, else one. Shared by
// the host, which sizes the launch, and the instances built for one shape,
// for which it is a constant.
constexpr std::size_t kMaxSmem = 227 * 1024;
__host__ __device__ constexpr int tile_stages(int head_dim, int block_size) {
  return 2 * detail::QuantTile<__half>::tile_bytes(head_dim, block_size) +
                     detail::QuantTile<__half>::scratch_bytes(head_dim, block_size) <=
                 kMaxSmem
             ? 2
             : 1;
}

struct StoreParams {
  const uint4* k;  // rows of num_kv_heads * head_dim halves, as 16-byte chunks
  const uint4* v;
  const RowSlot* fp16_rows;
  std::int32_t num_fp16_rows;
  std::int32_t rows_per_copy_unit;  // FP16 rows a copy unit takes
  std::int32_t copy_units;
  const WindowSlot* windows[2];  // INT4, INT2
  std::int32_t num_windows[2];
  std::int32_t stages;      // tile_stages of the shape
  FastDivisor heads;        // num_kv_heads
  std::int32_t tiles;       // (num_windows[0] + num_windows[1]) * num_kv_heads
  std::int32_t int4_tiles;  // num_windows[0] * num_kv_heads
  DevicePool pools[kNumPrecisions];
};

// Starts copying window rows [first_row, first_row + S) of KV head `head`
// into the FP16 tile as they are (16-byte row chunks into padded rows) with
// cp.async: the copies go global -> shared without passing through
// registers, so all of a thread's chunks are in flight at once with one
// instruction each, and they stay in flight while the thread quantizes the
// previous tile. The caller's cp.async.wait_all and __syncthreads() complete
// and publish them. The thread's chunks are walked by constant address
// steps (a row wrap adds a constant more): computing each address from its
// (row, col) took 37 instructions per K/V chunk pair, ~40% of the
// quantizer's own count at D 128, S 32.
template <typename E>
__device__ __forceinline__ void load_window(const uint4* k, const uint4* v, std::int32_t first_row, int head, int heads,
                                            int D, int S, E* tile) {
  const int chunks_per_row = D / 8;  // of one head
  const int pitch_bytes = detail::QuantTile<E>::pitch(D) * static_cast<int>(sizeof(E));
  const std::size_t input_row_bytes = static_cast<std::size_t>(heads) * D * sizeof(E);
  detail::StridedIndex i(chunks_per_row, kThreads);
  std::size_t src = __cvta_generic_to_global(k) +
                    (static_cast<std::size_t>(first_row + i.row) * heads + head) * D * sizeof(E) + 16 * i.col;
  const std::size_t v_minus_k = __cvta_generic_to_global(v) - __cvta_generic_to_global(k);  // mod 2^64
  auto at = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile)) + i.row * pitch_bytes + 16 * i.col;
  const auto v_tile = static_cast<std::uint32_t>(S * pitch_bytes);
  const std::size_t src_step = i.row_step * input_row_bytes + 16 * i.col_step;
  const std::uint32_t at_step = i.row_step * pitch_bytes + 16 * i.col_step;
  const std::size_t src_wrap = input_row_bytes - 16 * chunks_per_row;  // col -= chunks_per_row, ++row
  const std::uint32_t at_wrap = pitch_bytes - 16 * chunks_per_row;
  for (; i.row < S; i.row += i.row_step, i.col += i.col_step, src += src_step, at += at_step) {
    // .cg: the input is read once, so it bypasses L1.
    detail::cp_async_16_at<0>(at, reinterpret_cast<const void*>(src));
    detail::cp_async_16_at<0>(at + v_tile, reinterpret_cast<const void*>(src + v_minus_k));
    if (i.col_step != 0 && i.col + i.col_step >= chunks_per_row) {  // as in StridedIndex::next
      i.col -= chunks_per_row;
      ++i.row;
      src += src_wrap;
      at += at_wrap;
    }
  }
}

// Quantized tile `j`: KV head j % heads of window j / heads of the INT4
// list, then of the INT2 list.
__device__ __forceinline__ bool tile_is_int2(const StoreParams& p, int j) { return j >= p.int4_tiles; }
__device__ __forceinline__ WindowSlot tile_window(const StoreParams& p, int j) {
  const int window = p.heads.div(j);
  return window < p.num_windows[0] ? p.windows[0][window] : p.windows[1][window - p.num_windows[0]];
}
__device__ __forceinline__ int tile_head(const StoreParams& p, int j) { return p.heads.mod(j); }

// Head `head` (of `heads`) of block `block_id` of `pool`, the INT4 or INT2
// pool as kBits says, in an instance built for one shape. The block is addressed through
// a view whose format takes its precision from kBits and its sizes from the
// template: the head size is then a constant (through the pool's own format
// the precision was read and branched on at run time, ~60 instructions a
// tile).
template <int kBits, int kHeadDim, int kBlockSize>
__device__ __forceinline__ char* head_region(const DevicePool& pool, std::int32_t block_id, int head, int heads) {
  static_assert(kHeadDim != 0 && kBlockSize != 0, "for the instances built for one shape");
  const BlockFormat layout{kBits == 4 ? Precision::INT4 : Precision::INT2, heads, kHeadDim, kBlockSize};
  return reinterpret_cast<char*>(pool.block(block_id, layout)) + layout.head_offset(head);
}

// Quantizes `tile` into that head region (store_prefill_kernel's tiles).
template <typename E, int kBits, int kHeadDim, int kBlockSize>
__device__ __forceinline__ void quantize_into(const DevicePool& pool, std::int32_t block_id, int head, const E* tile,
                                              float* scratch) {
  const BlockFormat& format = pool.view.format;
  char* out = head_region<kBits, kHeadDim, kBlockSize>(pool, block_id, head, format.num_kv_heads);
  detail::quantize_tile_bits<E, kThreads, kBits, kHeadDim, kBlockSize, E>(format, tile, scratch, out);
}

// Copy unit `unit` of a warp: FP16 rows [R unit, R unit + R) of
// p.fp16_rows (R = p.rows_per_copy_unit), as K/V chunk pairs (16 bytes of
// a row's K and the V at the same place) that the lanes take in turn,
// kCopyPairs a lane loaded before any is stored. The list holds only the
// rows to copy: no barrier, no scan over the quantized rows' slots (the
// CTA-wide copy it replaces read every row's slot, which added a barrier
// and a dependent round trip to every CTA of a quantized plan).
template <int kHeadDim, int kBlockSize>
__device__ __forceinline__ void copy_unit(const StoreParams& p, int unit) {
  const DevicePool& pool = p.pools[0];
  const BlockFormat& f = pool.view.format;
  const int D = detail::fixed_or(kHeadDim, f.head_dim);
  const int S = detail::fixed_or(kBlockSize, f.block_size);
  const int heads = f.num_kv_heads;
  const BlockFormat layout{Precision::FP16, heads, D, S};
  const int chunks_per_head = D / 8;
  const int first = unit * p.rows_per_copy_unit;
  const int pairs = min(p.rows_per_copy_unit, p.num_fp16_rows - first) * heads * chunks_per_head;
  const int lane = static_cast<int>(threadIdx.x % 32);
  // Pair c: chunk c % chunks_per_head of head h of the unit's row r, where
  // c / chunks_per_head = r * heads + h.
  for (int base = lane; base < pairs; base += 32 * kCopyPairs) {
    uint4 kx[kCopyPairs], vx[kCopyPairs];
    std::int32_t slot[kCopyPairs];
#pragma unroll
    for (int u = 0; u < kCopyPairs; ++u) {
      const int c = base + 32 * u;
      if (c < pairs) {
        const int rh = c / chunks_per_head;
        const int r = p.heads.div(rh);
        const RowSlot at = p.fp16_rows[first + r];
        const std::size_t src =
            (static_cast<std::size_t>(at.row) * heads + (rh - r * heads)) * chunks_per_head + c % chunks_per_head;
        kx[u] = __ldcs(p.k + src);
        vx[u] = __ldcs(p.v + src);
        slot[u] = at.slot;
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyPairs; ++u) {
      const int c = base + 32 * u;
      if (c < pairs) {
        const int head = p.heads.mod(c / chunks_per_head);
        char* row = reinterpret_cast<char*>(pool.block(slot[u] / S, layout)) + layout.head_offset(head) +
                    static_cast<std::size_t>(slot[u] % S) * D * 2 + 16 * (c % chunks_per_head);
        *reinterpret_cast<uint4*>(row + layout.k_offset()) = kx[u];
        *reinterpret_cast<uint4*>(row + layout.v_offset()) = vx[u];
      }
    }
  }
}

// Persistent CTAs: CTA b quantizes tiles b, b + G, b + 2G, ... (G =
// gridDim.x, sized on the host so that every CTA gets the same number of
// tiles, give or take one); its warps first take the copy units w, w + W,
// ... (W = the grid's warps) while its first tile loads. Tiles go
// through two shared-memory stages: tile i + 1 is loaded while tile i is
// quantized, so a CTA's loads no longer wait behind its own math (one tile
// per CTA serialized load -> stats -> codes -> exit). Tiles too large for
// two stages take one, loaded after the previous tile's codes.
// kHeadDim, kBlockSize: the shape of an instance built for one (store_kernel
// lists them), or 0, 0: any shape, read from the format (fixed_or); the
// force-inlined helpers get the constants through their arguments.
template <typename E, int kHeadDim, int kBlockSize>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) store_prefill_kernel(const __grid_constant__ StoreParams p) {
  static_assert((kHeadDim == 0) == (kBlockSize == 0), "a shape is fixed whole or not at all");
  __builtin_assume(threadIdx.x < kThreads);  // bounds the threads' strided loops: at a fixed shape they unroll
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const BlockFormat& f16 = p.pools[0].view.format;
  const int heads = f16.num_kv_heads;
  const int D = detail::fixed_or(kHeadDim, f16.head_dim);
  const int S = detail::fixed_or(kBlockSize, f16.block_size);
  const int stages = kHeadDim != 0 ? tile_stages(kHeadDim, kBlockSize) : p.stages;
  const int tiles = p.tiles;
  const int G = static_cast<int>(gridDim.x);
  const std::size_t stage_bytes = detail::QuantTile<E>::tile_bytes(D, S);
  auto stage = [&](int i) { return reinterpret_cast<E*>(smem_bytes + (i & (stages - 1)) * stage_bytes); };
  float* scratch = reinterpret_cast<float*>(smem_bytes + stages * stage_bytes);
  // Windows are read one tile ahead of their use: tile i + 2's is loaded
  // while tile i is quantized, so no cp.async issue waits for a window
  // read (which, with every warp behind it at the next barrier, delayed
  // each tile's math by a global load's latency).
  int j = blockIdx.x;
  WindowSlot current{}, next{};
  if (j < tiles) {  // the first tile loads while the FP16 rows are copied
    current = tile_window(p, j);
    if (j + G < tiles) next = tile_window(p, j + G);
    load_window(p.k, p.v, current.first_row, tile_head(p, j), heads, D, S, stage(0));
  }
  constexpr int kWarps = kThreads / 32;
  for (int u = static_cast<int>(blockIdx.x * kWarps + threadIdx.x / 32); u < p.copy_units;
       u += static_cast<int>(gridDim.x) * kWarps) {
    copy_unit<kHeadDim, kBlockSize>(p, u);
  }
  for (int i = 0; j < tiles; ++i, j += G) {
    detail::cp_async_wait_all();  // tile i: the only copies in flight
    // Publishes tile i; every thread is past tile i - 1's codes, so its
    // stage and the scratch may be overwritten.
    __syncthreads();
    const bool more = j + G < tiles;
    WindowSlot after{};
    if (more) {
      if (j + 2 * G < tiles) after = tile_window(p, j + 2 * G);
      if (stages == 2) load_window(p.k, p.v, next.first_row, tile_head(p, j + G), heads, D, S, stage(i + 1));
    }
    if constexpr (kHeadDim == 0) {
      // The pool and its address chosen before the branch: per branch (as
      // below) the generic instance, with every size a runtime value,
      // spilled 136 bytes.
      const bool int2 = tile_is_int2(p, j);
      const DevicePool& pool = p.pools[int2 ? 2 : 1];
      const BlockFormat& format = pool.view.format;
      char* out = reinterpret_cast<char*>(pool.block(current.block_id)) + format.head_offset(tile_head(p, j));
      if (int2) {
        detail::quantize_tile_bits<E, kThreads, 2, 0, 0, E>(format, stage(i), scratch, out);
      } else {
        detail::quantize_tile_bits<E, kThreads, 4, 0, 0, E>(format, stage(i), scratch, out);
      }
    } else if (tile_is_int2(p, j)) {
      quantize_into<E, 2, kHeadDim, kBlockSize>(p.pools[2], current.block_id, tile_head(p, j), stage(i), scratch);
    } else {
      quantize_into<E, 4, kHeadDim, kBlockSize>(p.pools[1], current.block_id, tile_head(p, j), stage(i), scratch);
    }
    if (more && stages == 1) {
      __syncthreads();  // the one stage is free once every thread is past the codes
      // The window read again rather than kept through the codes (a spill
      // at 64 registers); this load's latency is exposed here anyway.
      load_window(p.k, p.v, tile_window(p, j + G).first_row, tile_head(p, j + G), heads, D, S, stage(0));
    }
    current = next;
    next = after;
  }
}

// Tiles by warp units (quantize_warp.cuh), for the shapes WarpTileUnits
// applies to: one unit a warp, the copy units first (copy_unit), then unit
// w % kPerTile of tile w / kPerTile for the warps after them, so that every
// warp's loads are in flight from its start and the hardware fills an SM
// with the next CTAs as warps finish (the persistent CTAs of
// store_prefill_kernel took ~4 tiles each in sequence at 19,600 tokens, a
// load's latency exposed at each).
template <typename E, int kHeadDim, int kBlockSize>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    store_prefill_units_kernel(const __grid_constant__ StoreParams p) {
  using Units = detail::WarpTileUnits<kHeadDim, kBlockSize>;
  static_assert(Units::kApplies);
  const int warp_unit = static_cast<int>(blockIdx.x) * (kThreads / 32) + static_cast<int>(threadIdx.x) / 32;
  if (warp_unit < p.copy_units) {  // the whole warp
    copy_unit<kHeadDim, kBlockSize>(p, warp_unit);
    return;
  }
  const int unit = warp_unit - p.copy_units;
  const int j = unit / Units::kPerTile;
  if (j < p.tiles) {  // the whole warp
    const int part = unit % Units::kPerTile;
    const WindowSlot window = tile_window(p, j);
    const int head = tile_head(p, j);
    const int heads = p.pools[0].view.format.num_kv_heads;
    const std::size_t row_halves = static_cast<std::size_t>(heads) * kHeadDim;
    const std::size_t tile_first = (static_cast<std::size_t>(window.first_row) * heads + head) * kHeadDim;
    const auto* k = reinterpret_cast<const E*>(p.k) + tile_first;
    const auto* v = reinterpret_cast<const E*>(p.v) + tile_first;
    auto quantize = [&]<int kBits>(const DevicePool& pool) {
      char* out = head_region<kBits, kHeadDim, kBlockSize>(pool, window.block_id, head, heads);
      if (part < Units::kKUnits) {
        detail::quantize_k_unit<E, kBits, kHeadDim, kBlockSize>(k, row_halves, part * Units::kKChannels, out);
      } else {
        detail::quantize_v_unit<E, kBits, kHeadDim, kBlockSize>(v, row_halves,
                                                                (part - Units::kKUnits) * Units::kVTokens, out);
      }
    };
    if (tile_is_int2(p, j)) {
      quantize.template operator()<2>(p.pools[2]);
    } else {
      quantize.template operator()<4>(p.pools[1]);
    }
  }
}

#if defined(MIXKV_ALL_KERNEL_INSTANCES)
#define MIXKV_STORE_ALL_SHAPES 1
#else
#define MIXKV_STORE_ALL_SHAPES 0
#endif

// A kernel of store_prefill: store_prefill_units_kernel (units_per_tile
// warps a tile, no shared memory for tiles) or store_prefill_kernel
// (units_per_tile 0: persistent CTAs, tiles staged in shared memory).
struct StoreKernel {
  void (*kernel)(StoreParams);
  int units_per_tile;
};

template <typename E, int kHeadDim, int kBlockSize>
StoreKernel store_instance() {
  using Units = detail::WarpTileUnits<kHeadDim, kBlockSize>;
  if constexpr (Units::kApplies) {
    return {store_prefill_units_kernel<E, kHeadDim, kBlockSize>, Units::kPerTile};
  } else {
    return {store_prefill_kernel<E, kHeadDim, kBlockSize>, 0};
  }
}

// THE dispatch point of store_prefill: (head_dim, block_size) -> the
// instance built for that shape, else the generic one (every shape
// check_pool accepts). Built by default: the decode kernels' default shapes,
// {64, 128, 256} x {32} plus {128} x {16, 64}; MIXKV_ALL_KERNEL_INSTANCES
// adds the rest of {64, 128, 256} x {16, 32, 64}. The same shapes for
// either type E.
template <typename E>
StoreKernel store_kernel(int head_dim, int block_size) {
  switch (head_dim) {
    case 64:
      if (block_size == 32) return store_instance<E, 64, 32>();
#if MIXKV_STORE_ALL_SHAPES
      if (block_size == 16) return store_instance<E, 64, 16>();
      if (block_size == 64) return store_instance<E, 64, 64>();
#endif
      break;
    case 128:
      if (block_size == 16) return store_instance<E, 128, 16>();
      if (block_size == 32) return store_instance<E, 128, 32>();
      if (block_size == 64) return store_instance<E, 128, 64>();
      break;
    case 256:
      if (block_size == 32) return store_instance<E, 256, 32>();
#if MIXKV_STORE_ALL_SHAPES
      if (block_size == 16) return store_instance<E, 256, 16>();
      if (block_size == 64) return store_instance<E, 256, 64>();
#endif
      break;
  }
  return {store_prefill_kernel<E, 0, 0>, 0};
}

// Compiled in store_bf16.cu.
extern template StoreKernel store_kernel<__nv_bfloat16>(int head_dim, int block_size);

}  // namespace mixkv::gpu::store_kernels
