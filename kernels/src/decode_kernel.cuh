#pragma once
// The paged decode attention kernel: one CTA (4 warps) per work item, i.e.
// per (sequence, KV head, range of its FP16 | INT4 | INT2 blocks).
//
// Orientation: tokens are the MMA's M dimension and the query-head group
// its N: NT n-tiles of 8 heads (NT = 1 up to 8 heads, 2 up to 16; the
// codes a thread extracts feed every n-tile), so a GQA group of 7 wastes
// 1/8 of the tensor work instead of 9/16 with heads as M:
//   S^T[token][head] = K[token][:] . Q^T          (m16n8k16, k = channels)
//   O^T[chan][head] += V^T[chan][token] . P^T     (m16n8k16, k = tokens)
// P^T comes out of the S^T accumulators through movmatrix (a register
// transpose). Dequantization is folded (docs/kernels.md): per-channel K
// scales multiply Q (q' = q * s_c, one half2 multiply per fragment) and the
// K minimums become one extra MMA per k-step (sum_c q_c m_c); per-token V
// scales multiply P and the V minimums a per-head scalar sum_t p_t m_t
// added once at the end. The tensor cores see the integer codes as FP16
// subnormals: one lop3 masks a code field into the mantissa under a zero
// exponent, the value 2^(k-24) x, so no offset has to be removed
// (quant_block_scores / _accumulate, decode_quant.cuh). The online softmax
// is decode_softmax.cuh.
//
// E, the cache's 16-bit type (elem16.cuh), is that of q, out, the FP16
// pool's rows and the (scale, min) parameters, and the MMAs' inputs. A BF16
// instance takes the codes as exact bfloat16 integers instead of
// subnormals (CodeField, decode_quant.cuh); all else is FP16's.
//
// Memory: each warp streams its own blocks through a private cp.async ring
// (16-byte copies, several blocks in flight; FP16 blocks go in 16-token
// units), so no CTA barrier sits in the main loop.
//
// Split items write a partial state and merge it in this kernel
// (decode_merge.cuh): no second launch.
//
// Permutations (free, since sums over tokens and channels do not care):
// in a quantized block the MMA row rho of m-tile mt is token
// (S/8)(rho % 8) + 2 mt + rho / 8, so each thread's tokens are S/8
// consecutive ones: one 4..32-bit run of every channel's packed K codes.
// In O^T, row rho of channel tile cm is channel (D/8)(rho % 8) + 2 cm +
// rho / 8, so each thread owns D/8 consecutive channels: one run of every
// token's packed V codes (and of every FP16 V row).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_merge.cuh"
#include "decode_params.cuh"
#include "decode_quant.cuh"
#include "decode_softmax.cuh"
#include "device_math.cuh"
#include "elem16.cuh"
#include "mixkv/core/block_format.h"

namespace mixkv::gpu::detail {

inline constexpr int kDecodeThreads = 32 * kDecodeWarps;
// Query heads of one MMA n-tile.
inline constexpr int kHeadsPerTile = 8;

constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int cmin(int a, int b) { return a < b ? a : b; }

template <int D, int S, int NT>
struct DecodeTile {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(S == 16 || S == 32 || S == 64, "block_size");
  static constexpr int kFp16UnitTokens = 16;
  static constexpr int kFp16UnitBytes = kFp16UnitTokens * D * 2 * 2;  // K and V rows
  static constexpr int kInt4Bytes = static_cast<int>(BlockFormat{Precision::INT4, 1, D, S}.head_bytes());
  static constexpr int kInt2Bytes = static_cast<int>(BlockFormat{Precision::INT2, 1, D, S}.head_bytes());
  // Per-warp ring: at least two units of the largest kind, and 16 KiB, so
  // that small blocks can go up to 8 deep (stages()).
  static constexpr int kRingBytes = (cmax(16384, 2 * cmax(kFp16UnitBytes, kInt4Bytes)) + 127) / 128 * 128;
  template <Precision P>
  static constexpr int unit_bytes() {
    return P == Precision::FP16 ? kFp16UnitBytes : (P == Precision::INT4 ? kInt4Bytes : kInt2Bytes);
  }
  // Ring stages of a unit kind: as many as the ring holds (<= 8), except
  // for INT2. The quantized loop holds two blocks in the ring and keeps the
  // rest in flight, and an INT2 warp, bound by its instructions, does not
  // need more bytes in flight than an INT4 warp: when every CTA slot of the
  // GPU is busy (kBusyGpu), one block, or deeper INT2 prefetches lengthen
  // the memory latency that the INT4 and FP16 warps of a mixed plan wait
  // on; otherwise as many bytes as an INT4 block, which fewer warps an SM
  // need to keep memory busy.
  template <Precision P, bool kBusyGpu = false>
  static constexpr int stages() {
    const int fit = cmin(8, kRingBytes / unit_bytes<P>());
    if constexpr (P != Precision::INT2) return fit;
    return cmin(fit, 2 + (kBusyGpu ? 1 : (kInt4Bytes + kInt2Bytes - 1) / kInt2Bytes));
  }
  static constexpr int kHeads = kHeadsPerTile * NT;
  static constexpr int kMergeBytes = kDecodeWarps * kHeads * (D + 2) * 4;
  static constexpr int kSmemBytes = cmax(kDecodeWarps * kRingBytes, kMergeBytes);
  // CTAs per SM the registers are allocated for (__launch_bounds__): as
  // many as shared memory admits on sm_90 (228 KiB, 1 KiB reserved per
  // CTA), so ptxas neither spills for more nor shrinks occupancy below it;
  // 64-token blocks and two head tiles keep the 2 their quantized loop's
  // ~200 registers allow.
  static constexpr int kMinCtasPerSm = cmin(S == 64 || NT == 2 ? 2 : 3, cmax(1, 233472 / (kSmemBytes + 1024)));
};

// Bank-conflict-free placement of 16-byte chunks of FP16 rows in shared
// memory: K rows are read by ldmatrix (8 rows of one chunk column), V rows
// by 16-byte loads of tokens 2r.. and channel runs of g.
__device__ __forceinline__ int k_swizzle(int chunk, int row) { return chunk ^ (row & 7); }
__device__ __forceinline__ int v_swizzle(int chunk, int row) {
  return chunk ^ ((((row >> 1) & 1) * 5) ^ (((row >> 2) & 1) * 2));
}

// ---------------------------------------------------------------- loads --

// 16 tokens (rows 16 sub .. 16 sub + 15) of an FP16 head: K rows then V rows;
// rows at or past `valid_rows` are zero-filled without reading memory.
template <int D, int S>
__device__ __forceinline__ void load_fp16_unit(char* slot, const char* head, int sub, int valid_rows, int lane) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = 16 * kChunksPerRow;
  const char* k_src = head + sub * 16 * D * 2;
  const char* v_src = head + S * D * 2 + sub * 16 * D * 2;
  char* v_dst = slot + 16 * D * 2;
#pragma unroll
  for (int i = lane; i < kChunks; i += 32) {
    const int row = i / kChunksPerRow;
    const int chunk = i % kChunksPerRow;
    const int bytes = row < valid_rows ? 16 : 0;
    cp_async_16(slot + row * D * 2 + k_swizzle(chunk, row) * 16, k_src + row * D * 2 + chunk * 16, bytes);
    cp_async_16(v_dst + row * D * 2 + v_swizzle(chunk, row) * 16, v_src + row * D * 2 + chunk * 16, bytes);
  }
}

// Chunks lane + 32 j of a quantized head: one shared and one global address
// per lane, each round's 512 j an immediate of the copy (a register per
// round and two 64-bit adds per copy otherwise).
template <int Bytes, int J = 0>
__device__ __forceinline__ void load_quant_chunks(uint32_t dst, const char* src, int lane) {
  constexpr int kChunks = Bytes / 16;
  if constexpr (32 * J < kChunks) {
    if (32 * (J + 1) <= kChunks || lane + 32 * J < kChunks) cp_async_16_at<512 * J>(dst, src);
    load_quant_chunks<Bytes, J + 1>(dst, src, lane);
  }
}

template <int Bytes>
__device__ __forceinline__ void load_quant_head(char* slot, const char* head, int lane) {
  load_quant_chunks<Bytes>(static_cast<uint32_t>(__cvta_generic_to_shared(slot)) + 16 * lane, head + 16 * lane, lane);
}

// -------------------------------------------------------------- compute --

// One FP16 unit of 16 tokens (natural token order).
template <typename E, int D, int NT>
__device__ __forceinline__ void compute_fp16_unit(const char* slot, int valid_rows, const uint32_t (&qf)[NT][D / 16][2],
                                                  float scale_log2, WarpState<D, NT>& st, int lane) {
  const int g = lane >> 2;
  const int r = lane & 3;
  float s[NT][1][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) s[nt][0][0] = s[nt][0][1] = s[nt][0][2] = s[nt][0][3] = 0.0f;
  {
    const int row = lane & 15;  // ldmatrix: lanes 0-7 / 8-15 rows of m0 / m1, 16-31 the same rows, k + 8
    const char* k_row = slot + row * D * 2;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, k_row + k_swizzle(2 * ks + (lane >> 4), row) * 16);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Elem16<E>::mma_16816(s[nt][0], a, qf[nt][ks][0], qf[nt][ks][1]);
    }
  }
  uint32_t b[NT][2];  // P^T as B fragments
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0][0] = g < valid_rows ? s[nt][0][0] : -INFINITY;
    s[nt][0][1] = g < valid_rows ? s[nt][0][1] : -INFINITY;
    s[nt][0][2] = g + 8 < valid_rows ? s[nt][0][2] : -INFINITY;
    s[nt][0][3] = g + 8 < valid_rows ? s[nt][0][3] : -INFINITY;
  }
  online_softmax<NT, 1>(s, scale_log2, st);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    b[nt][0] = movmatrix_trans(pack2<E>(s[nt][0][0], s[nt][0][1]));
    b[nt][1] = movmatrix_trans(pack2<E>(s[nt][0][2], s[nt][0][3]));
  }

  const char* v_rows = slot + 16 * D * 2;
  const int tokens[4] = {2 * r, 2 * r + 1, 2 * r + 8, 2 * r + 9};
#pragma unroll
  for (int h = 0; h < D / 64; ++h) {  // 16-byte chunk h of the thread's D/8 channels = channel tiles 4h..4h+3
    uint4 w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      w[t] = *reinterpret_cast<const uint4*>(v_rows + tokens[t] * D * 2 + v_swizzle((D / 64) * g + h, tokens[t]) * 16);
    }
    const uint32_t* w0 = &w[0].x;
    const uint32_t* w1 = &w[1].x;
    const uint32_t* w2 = &w[2].x;
    const uint32_t* w3 = &w[3].x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t a[4] = {prmt(w0[j], w1[j], 0x5410), prmt(w0[j], w1[j], 0x7632), prmt(w2[j], w3[j], 0x5410),
                             prmt(w2[j], w3[j], 0x7632)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Elem16<E>::mma_16816(st.acc[nt][4 * h + j], a, b[nt][0], b[nt][1]);
    }
  }
}

// ------------------------------------------------------------- segments --

// The warp's share (units warp, warp + 4, ...) of blocks [lo, hi) of one
// pool's list, streamed through the warp's ring. lead_id: the page id of
// the warp's first unit's block when the plan carried it (the item's first
// segment), else -1.
template <typename E, int D, int S, int NT, Precision P, int kStages = DecodeTile<D, S, NT>::template stages<P>()>
__device__ __forceinline__ void run_segment(const DecodeParams& p, const std::int32_t* ids, int lo, int hi,
                                            int n_blocks, int fill, int kv_head, int lead_id, char* ring,
                                            const uint32_t (&qf)[NT][D / 16][2], WarpState<D, NT>& st, int warp,
                                            int lane) {
  using Tile = DecodeTile<D, S, NT>;
  constexpr int kUnitBytes = Tile::template unit_bytes<P>();
  constexpr int kUnitsPerBlock = P == Precision::FP16 ? S / 16 : 1;
  static_assert(kStages >= 1);
  const DevicePool& pool = p.pools[pool_index(P)];
  const std::size_t head_offset = pool.view.format.head_offset(kv_head);

  int units = (hi - lo) * kUnitsPerBlock;
  if (P == Precision::FP16 && hi == n_blocks) units -= kUnitsPerBlock - (fill + 15) / 16;
  const int count = units > warp ? (units - warp + kDecodeWarps - 1) / kDecodeWarps : 0;

  // valid token rows of unit k (FP16: only the list's last block is partial)
  auto unit_rows = [&](int k, int& block, int& sub) {
    const int u = warp + kDecodeWarps * k;
    block = lo + u / kUnitsPerBlock;
    sub = u % kUnitsPerBlock;
    if (P != Precision::FP16) return S;
    const int tokens = block == n_blocks - 1 ? fill : S;
    const int rows = tokens - 16 * sub;
    return rows < 16 ? rows : 16;
  };
  // Lane l holds the head address of the warp's unit 32 w + l of the
  // current window w of 32 units, found together: one page-table load and
  // one slab division per 32 units, instead of a dependent global load and
  // ~30 address instructions in front of every unit's copies.
  const char* lane_head = nullptr;
  auto look_up_window = [&](int k) {
    int block, sub;
    unit_rows(k + lane, block, sub);
    lane_head = k + lane < count ? reinterpret_cast<const char*>(pool.block(ids[block])) + head_offset : nullptr;
  };
  auto copy = [&](int k, int stage, const char* head) {
    char* dst = ring + stage * kUnitBytes;
    if constexpr (P == Precision::FP16) {
      int block, sub;
      const int rows = unit_rows(k, block, sub);
      load_fp16_unit<D, S>(dst, head, sub, rows, lane);
    } else {
      load_quant_head<kUnitBytes>(dst, head, lane);
    }
  };
  auto issue = [&](int k, int stage) {
    if ((k & 31) == 0) look_up_window(k);  // units are issued in order: a new window
    copy(k, stage,
         reinterpret_cast<const char*>(
             __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(lane_head), k & 31)));
  };

  if constexpr (P != Precision::FP16) scale_acc_to_codes<E, bits_of(P)>(st, true);
  // Unit 0's copy goes out before the window's page-table loads when the
  // plan gave its page id.
  const bool lead = lead_id >= 0 && count > 0;
  if (lead) copy(0, 0, reinterpret_cast<const char*>(pool.block(lead_id)) + head_offset);
#pragma unroll
  for (int stage = 0; stage < kStages; ++stage) {
    if (stage < count) {
      if (stage == 0 && lead) {
        look_up_window(0);
      } else {
        issue(stage, stage);
      }
    }
    cp_async_commit();
  }
  if constexpr (P == Precision::FP16) {
    for (int k = 0; k < count; ++k) {
      cp_async_wait<kStages - 1>();
      __syncwarp();
      const int stage = k % kStages;
      int block, sub;
      const int rows = unit_rows(k, block, sub);
      compute_fp16_unit<E, D, NT>(ring + stage * kUnitBytes, rows, qf, p.scale_log2, st, lane);
      __syncwarp();
      if (k + kStages < count) issue(k + kStages, stage);
      cp_async_commit();
    }
  } else if (count > 0) {
    // Software-pipelined by one block: iteration k exponentiates block k's
    // scores, then computes block k + 1's scores (K side, thread maxima)
    // beside block k's V side, so that the warp has two independent MMA
    // chains in flight where one block alone is a serial chain (K MMAs ->
    // max -> exp2 -> V MMAs) that its latency, not the issue rate, sets.
    // Block k + 1 must have landed: one ring stage less of prefetch.
    static_assert(kStages >= 2, "the pipelined loop holds two blocks in the ring");
    constexpr int MT = S / 16;
    constexpr int kBits = bits_of(P);
    float e[NT][MT][4];
    float tm[NT][2];
    float lim = kRescaleSlack;  // quant_rescale
    bool unset = false;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) unset = unset || st.m[nt][0] == -INFINITY || st.m[nt][1] == -INFINITY;
    if (unset) {
      lim = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) st.m[nt][0] = st.m[nt][1] = 0.0f;
    }
    cp_async_wait<kStages - 1>();
    __syncwarp();
    quant_block_scores<E, D, S, kBits, NT>(p, ring, qf, st.m, e, lane);
    thread_max<NT, MT>(e, tm);
    // Ring stages of blocks k and k + 1 as counters (a modulo by the
    // stage count costs a multiply-high chain per block).
    int stage = 0;
    int next_stage = 1 % kStages;
    // The last block is peeled off, so the loop body has no branch between
    // block k + 1's K side and block k's V side that ptxas would not
    // schedule across.
    for (int k = 0; k + 1 < count; ++k) {
      quant_rescale<NT, MT>(tm, lim, st, e);
      cp_async_wait<kStages - 2>();
      __syncwarp();
      exponentiate<NT, MT>(e, st);
      // Block k + 1's exponents against the max after block k: its own
      // rescale, if any, shifts them.
      float next[NT][MT][4];
      quant_block_scores<E, D, S, kBits, NT>(p, ring + next_stage * kUnitBytes, qf, st.m, next, lane);
      quant_block_accumulate<E, D, S, kBits, NT>(ring + stage * kUnitBytes, e, st, lane);
      thread_max<NT, MT>(next, tm);
      __syncwarp();
      if (k + kStages < count) issue(k + kStages, stage);
      cp_async_commit();
      stage = next_stage;
      next_stage = next_stage + 1 == kStages ? 0 : next_stage + 1;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          e[nt][mt][0] = next[nt][mt][0];
          e[nt][mt][1] = next[nt][mt][1];
          e[nt][mt][2] = next[nt][mt][2];
          e[nt][mt][3] = next[nt][mt][3];
        }
      }
    }
    quant_rescale<NT, MT>(tm, lim, st, e);
    exponentiate<NT, MT>(e, st);
    quant_block_accumulate<E, D, S, kBits, NT>(ring + stage * kUnitBytes, e, st, lane);
  }
  cp_async_wait<0>();
  __syncwarp();
  if constexpr (P != Precision::FP16) scale_acc_to_codes<E, bits_of(P)>(st, false);
}

// ---------------------------------------------------------------- kernel --

template <typename E, int D, int S, int NT>
__global__ void __launch_bounds__(kDecodeThreads, DecodeTile<D, S, NT>::kMinCtasPerSm)
    paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Tile = DecodeTile<D, S, NT>;
  extern __shared__ __align__(128) char smem[];
  const int2 range = p.item_range != nullptr ? *p.item_range : p.launch_range;
  if (static_cast<int>(blockIdx.x) >= range.y) return;
  const DecodeWorkItem item = p.items[range.x + blockIdx.x];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int r = lane & 3;
  const int group = p.group;

  const int slot = item.slot;
  const int n[kNumPrecisions] = {item.counts[0], item.counts[1], item.counts[2]};
  const int fill = item.fill;

  // Q^T as B fragments of n-tile nt (head h = 8 nt + g):
  // b0 = Q[h][16 ks + 2r ..], b1 = Q[h][16 ks + 2r + 8 ..]
  uint32_t qf[NT][D / 16][2];
  {
    const E* q = values16<E>(p.q) + (static_cast<std::size_t>(item.seq) * p.num_q_heads + item.q_head) * D;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int h = kHeadsPerTile * nt + g;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        qf[nt][ks][0] = h < group ? *reinterpret_cast<const uint32_t*>(q + h * D + 16 * ks + 2 * r) : 0u;
        qf[nt][ks][1] = h < group ? *reinterpret_cast<const uint32_t*>(q + h * D + 16 * ks + 2 * r + 8) : 0u;
      }
    }
  }

  WarpState<D, NT> st;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int cm = 0; cm < D / 16; ++cm)
      st.acc[nt][cm][0] = st.acc[nt][cm][1] = st.acc[nt][cm][2] = st.acc[nt][cm][3] = 0.0f;
    st.m[nt][0] = st.m[nt][1] = -INFINITY;
    st.l[nt][0] = st.l[nt][1] = st.vb[nt][0] = st.vb[nt][1] = 0.0f;
  }

  char* ring = smem + warp * Tile::kRingBytes;
  const std::int32_t* table = p.blocks + static_cast<std::size_t>(slot) * p.max_blocks;
  const std::size_t pool_stride = static_cast<std::size_t>(p.max_sequences) * p.max_blocks;
  int first = 0;  // virtual index of the pool's first block
  // For the item's first segment only. Read from global memory beside the
  // item: indexing the item's copy by warp would put it in local memory.
  int lead_id = p.items[range.x + blockIdx.x].lead_ids[warp];
  {
    const int lo = max(item.begin - first, 0), hi = min(item.end - first, n[0]);
    if (lo < hi) {
      run_segment<E, D, S, NT, Precision::FP16>(p, table, lo, hi, n[0], fill, item.kv_head, lead_id, ring, qf, st, warp,
                                                lane);
      lead_id = -1;
    }
    first += n[0];
  }
  {
    const int lo = max(item.begin - first, 0), hi = min(item.end - first, n[1]);
    if (lo < hi) {
      run_segment<E, D, S, NT, Precision::INT4>(p, table + pool_stride, lo, hi, n[1], S, item.kv_head, lead_id, ring,
                                                qf, st, warp, lane);
      lead_id = -1;
    }
    first += n[1];
  }
  {
    const int lo = max(item.begin - first, 0), hi = min(item.end - first, n[2]);
    if (lo < hi) {
      constexpr Precision P = Precision::INT2;
      if (range.y >= p.resident_ctas) {
        run_segment<E, D, S, NT, P, Tile::template stages<P, true>()>(p, table + 2 * pool_stride, lo, hi, n[2], S,
                                                                      item.kv_head, lead_id, ring, qf, st, warp, lane);
      } else {
        run_segment<E, D, S, NT, P>(p, table + 2 * pool_stride, lo, hi, n[2], S, item.kv_head, lead_id, ring, qf, st,
                                    warp, lane);
      }
    }
  }

  // ---- combine the four warps' states, then normalize and write
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      st.l[nt][0] += __shfl_xor_sync(0xffffffffu, st.l[nt][0], offset);
      st.l[nt][1] += __shfl_xor_sync(0xffffffffu, st.l[nt][1], offset);
      st.vb[nt][0] += __shfl_xor_sync(0xffffffffu, st.vb[nt][0], offset);
      st.vb[nt][1] += __shfl_xor_sync(0xffffffffu, st.vb[nt][1], offset);
    }
  }
  __syncthreads();  // every ring is drained; shared memory is reused
  // so: [warp][head][D] with the 4-channel groups of heads 2r, 2r + 1 XORed
  // by r, so that a quad's float2 stores fall in distinct banks (2-way
  // conflicts instead of 8-way) while 16-byte reads stay contiguous.
  constexpr int kHeads = Tile::kHeads;
  float* so = reinterpret_cast<float*>(smem);
  float* sm = so + kDecodeWarps * kHeads * D;  // [warp][head]
  float* sl = sm + kDecodeWarps * kHeads;      // [warp][head]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int h0 = kHeadsPerTile * nt + 2 * r;
    float* o0 = so + (warp * kHeads + h0) * D;
    float* o1 = o0 + D;
#pragma unroll
    for (int cm = 0; cm < D / 16; ++cm) {
      const int ch = ((D / 8) * g + 2 * cm) ^ (4 * r);
      const float add0 = st.vb[nt][0];
      const float add1 = st.vb[nt][1];
      *reinterpret_cast<float2*>(o0 + ch) = make_float2(st.acc[nt][cm][0] + add0, st.acc[nt][cm][2] + add0);
      *reinterpret_cast<float2*>(o1 + ch) = make_float2(st.acc[nt][cm][1] + add1, st.acc[nt][cm][3] + add1);
    }
    if (g == 0) {
      sm[warp * kHeads + h0] = st.m[nt][0];
      sm[warp * kHeads + h0 + 1] = st.m[nt][1];
      sl[warp * kHeads + h0] = st.l[nt][0];
      sl[warp * kHeads + h0 + 1] = st.l[nt][1];
    }
  }
  __syncthreads();
  // Each thread combines 16-byte vectors (4 channels of one head); the
  // per-head weights are recomputed per vector (4 exp2) rather than shared
  // through another barrier. This runs once per CTA on batch 1's critical
  // path, so the division and the log are paid a vector, not an element.
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr int kVecsPerHead = D / 4;
  for (int v = threadIdx.x; v < group * kVecsPerHead; v += kDecodeThreads) {
    const int head = v / kVecsPerHead;
    const int c4 = v % kVecsPerHead;
    float m[kDecodeWarps];
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m[w] = sm[w * kHeads + head];
      mx = fmaxf(mx, m[w]);
    }
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float sum = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float f = exp2f(m[w] - mx);
        const float4 x = reinterpret_cast<const float4*>(so + (w * kHeads + head) * D)[c4 ^ ((head >> 1) & 3)];
        sum += f * sl[w * kHeads + head];
        o.x += f * x.x;
        o.y += f * x.y;
        o.z += f * x.z;
        o.w += f * x.w;
      }
    }
    const float inv = sum > 0.0f ? __frcp_rn(sum) : 0.0f;
    const float4 value = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    const bool split = item.partial >= 0;
    const std::size_t row = split ? static_cast<std::size_t>(item.partial) * group + head
                                  : static_cast<std::size_t>(item.seq) * p.num_q_heads + item.q_head + head;
    if (split) {
      reinterpret_cast<float4*>(p.partial_out + row * D)[c4] = value;
    } else {
      auto* dst = reinterpret_cast<typename Elem16<E>::T2*>(values16<E>(p.out) + row * D + 4 * c4);
      dst[0] = Elem16<E>::round2(value.x, value.y);
      dst[1] = Elem16<E>::round2(value.z, value.w);
    }
    float* lse = split ? p.partial_lse : p.lse;
    if (c4 == 0 && lse != nullptr) lse[row] = sum > 0.0f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
  }
  if (item.partial >= 0) merge_split_item<E, D, kDecodeThreads, kHeads>(p, item, reinterpret_cast<int*>(so));
}

}  // namespace mixkv::gpu::detail
