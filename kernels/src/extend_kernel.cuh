#pragma once
// The paged extend (chunked-prefill) attention kernel, FlashAttention-2
// style: one CTA (4 warps) per work item, i.e. per tile of 64 rows of one
// (sequence, KV head) over a range of its units (extend_params.cuh).
//
// E, the cache's 16-bit type (elem16.cuh), is that of q, k, v, out, the
// FP16 pool's values and the quantized blocks' (scale, min), and the MMAs'
// inputs: dequantized blocks and P are rounded to it.
//
// Orientation: the tile's rows (new row j, query head h of the group, row
// m = j * group + h) are the MMAs' M dimension, 16 a warp; a unit's tokens
// are N for S = Q K^T and K for O += P V, both m16n8k16 E -> FP32:
//   S[row][token] = Q[row][:] . K[token][:]       (k = channels)
//   O[row][chan] += P[row][token] . V[token][chan] (k = tokens)
// Q stays in registers as A fragments up to head_dim 128 (shared memory at
// 256, where O's 128 accumulators a thread fill the registers); P is reused
// from the S accumulators as A fragments without a shuffle, and K and V
// come from shared memory through ldmatrix.
//
// A unit is one cached block (FP16, INT4 or INT2) or block_size new rows.
// FP16 blocks and new rows are copied with cp.async into token-major tiles.
// A quantized block is copied as its raw head region, then dequantized by
// the whole CTA into E tiles (V token-major; K channel-major, the layout
// its codes come in, read by a transposing ldmatrix into the same
// fragments): every offset comes from BlockFormat and every value from
// dequant's rule, so the byte format has one definition.
// Units are double buffered: unit u + 1's copies are in flight while unit u
// is dequantized and computed.
//
// Softmax: online, per row, in base 2 (scores times sm_scale * log2(e)),
// with the running max rescaling O and the row sums at every unit (FA2).
// Masks: tokens past an FP16 list's fill (zero-filled, never read), and
// for new rows the causal limit token j' <= j of the row.
#include <cuda_fp16.h>

#include <cstdint>

#include "device_math.cuh"
#include "elem16.cuh"
#include "extend_params.cuh"
#include "mixkv/core/block_format.h"
#include "quantize.cuh"

namespace mixkv::gpu::detail {

inline constexpr int kExtendThreads = 32 * kExtendWarps;

constexpr int extend_max(int a, int b) { return a > b ? a : b; }

template <int D, int S>
struct ExtendTile {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(S == 16 || S == 32 || S == 64, "block_size");
  static constexpr int kRows = kExtendTileRows;
  static constexpr bool kQInRegisters = D <= 128;
  static constexpr int kQRegs = kQInRegisters ? D / 16 : 1;  // A fragments of Q a thread keeps
  // Tile rows padded by one 16-byte chunk: a row is then an odd number of
  // chunks, so the 8 rows one ldmatrix phase reads at the same chunk fall
  // in 8 distinct 16-byte bank groups (no conflict, no swizzle).
  static constexpr int kRowPitch = D * 2 + 16;  // token-major row: one token's D halves
  static constexpr int kColPitch = S * 2 + 16;  // channel-major row: one channel's S halves
  static_assert((kRowPitch / 16) % 2 == 1 && (kColPitch / 16) % 2 == 1, "odd chunks a row");
  static constexpr int kQBytes = kRows * kRowPitch;
  static constexpr int kKTokenBytes = S * kRowPitch;    // token-major K: FP16 blocks, new rows
  static constexpr int kKChannelBytes = D * kColPitch;  // channel-major K: dequantized blocks
  static constexpr int kKBytes = extend_max(kKTokenBytes, kKChannelBytes);
  static constexpr int kVBytes = S * kRowPitch;
  static constexpr int kInt4Bytes = static_cast<int>(BlockFormat{Precision::INT4, 1, D, S}.head_bytes());
  static constexpr int kInt2Bytes = static_cast<int>(BlockFormat{Precision::INT2, 1, D, S}.head_bytes());
  static constexpr int kFp16HeadBytes = static_cast<int>(BlockFormat{Precision::FP16, 1, D, S}.head_bytes());
  static_assert(kInt4Bytes % 16 == 0 && kInt2Bytes % 16 == 0, "raw heads are copied in 16-byte chunks");
  static constexpr int kRawBytes = extend_max(kInt4Bytes, kInt2Bytes);
  static constexpr int kStageBytes = kKBytes + kVBytes + kRawBytes;
  static_assert(kQBytes % 16 == 0 && kKBytes % 16 == 0 && kVBytes % 16 == 0 && kStageBytes % 16 == 0,
                "16-byte aligned regions");
  static constexpr int kSmemBytes = kQBytes + 2 * kStageBytes;
  static_assert(kSmemBytes <= 227 * 1024, "sm_90 shared memory per CTA");
  // CTAs an SM the registers are sized for (__launch_bounds__): 2 up to
  // head_dim 128 (up to 255 registers a thread: 170 for 3 spilled), 1 at
  // 256, where O's 128 accumulators a thread take most of them.
  static constexpr int kMinCtasPerSm = D <= 128 ? 2 : 1;
};

// The running state of a warp's 16 rows (rows g and g + 8 of the thread).
template <int D>
struct ExtendRows {
  float o[D / 8][4];  // O fragments of channel tile nd: row g cols 2r, 2r+1; row g + 8 the same
  float m[2];         // running max (base 2) of rows g, g + 8; -inf before any valid score
  float l[2];         // this thread's part of their softmax sums
};

// ---------------------------------------------------------------- loads --

// Token rows [0, S) of a token-major tile from rows of `row_bytes` apart
// (K rows at k_src, V rows at v_src); rows at or past `valid` are
// zero-filled without reading memory (their source is row 0).
template <int D, int S>
__device__ __forceinline__ void load_token_rows(char* k_dst, char* v_dst, const char* k_src, const char* v_src,
                                                std::size_t row_bytes, int valid, int tid) {
  using Tile = ExtendTile<D, S>;
  constexpr int kChunks = D / 8;                          // 16-byte chunks a row
  constexpr int kRowsPerPass = kExtendThreads / kChunks;  // a thread's chunk is the same in every row it copies
  static_assert(kExtendThreads % kChunks == 0 && S % kRowsPerPass == 0, "whole passes");
  const int chunk = tid % kChunks;
#pragma unroll
  for (int pass = 0; pass < S / kRowsPerPass; ++pass) {
    const int t = tid / kChunks + pass * kRowsPerPass;
    const bool in = t < valid;
    const std::size_t at = (in ? static_cast<std::size_t>(t) * row_bytes : 0) + chunk * 16;
    cp_async_16(k_dst + t * Tile::kRowPitch + chunk * 16, k_src + at, in ? 16 : 0);
    cp_async_16(v_dst + t * Tile::kRowPitch + chunk * 16, v_src + at, in ? 16 : 0);
  }
}

// A quantized head region as it is stored, in 16-byte chunks.
template <int Bytes>
__device__ __forceinline__ void load_raw_head(char* dst, const char* head, int tid) {
#pragma unroll 4
  for (int i = tid; i < Bytes / 16; i += kExtendThreads) cp_async_16(dst + 16 * i, head + 16 * i);
}

// ---------------------------------------------------------- dequantize --

// Eight consecutive codes of `Bits` at `at` (little-endian, code j at bits
// j * Bits), from one 4- or 2-byte load.
template <int Bits>
__device__ __forceinline__ uint32_t eight_codes(const char* at) {
  if constexpr (Bits == 4) {
    return *reinterpret_cast<const uint32_t*>(at);
  } else {
    return *reinterpret_cast<const uint16_t*>(at);
  }
}

// dequant_device (quantize.cuh) of a code field: min + scale * code, each
// operation rounded as there; the code becomes a float through the bits of
// 2^23 + code (exact) instead of an integer conversion, a quarter-rate
// instruction on sm_90.
__device__ __forceinline__ float dequant_field(uint32_t code, float scale, float min) {
  const float x = __fsub_rn(__uint_as_float(kCodeBias | code), 8388608.0f);
  return __fadd_rn(min, __fmul_rn(scale, x));
}

// Eight dequantized values (code j at bits j * Bits of `codes`) as E, one
// 16-byte store.
template <typename E, int Bits>
__device__ __forceinline__ void store_eight(char* dst, uint32_t codes, float scale, float min) {
  constexpr uint32_t kMask = (1u << Bits) - 1u;
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = pack2<E>(dequant_field((codes >> (2 * i * Bits)) & kMask, scale, min),
                    dequant_field((codes >> ((2 * i + 1) * Bits)) & kMask, scale, min));
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
}

// The raw head region `raw` of a quantized block -> K channel-major
// (k_tile[c][t], kColPitch a row) and V token-major (v_tile[t][c]), E.
// A K task is 8 tokens of one channel (K codes are packed along tokens), a
// V task 8 channels of one token (V codes are packed along channels).
template <typename E, int D, int S, Precision P>
__device__ __forceinline__ void dequantize_block(const char* raw, char* k_tile, char* v_tile, int tid) {
  using Elem = Elem16<E>;
  using Tile = ExtendTile<D, S>;
  constexpr BlockFormat F{P, 1, D, S};
  constexpr int kBits = bits_of(P);
  constexpr int kTasks = D * S / 8;  // of K, and of V
  static_assert(kTasks % kExtendThreads == 0, "whole passes");
  // 8 tokens of a channel are kBits bytes, byte b holding tokens
  // 8 / kBits of them from 8 tc + b * 8 / kBits (k_code_location): where
  // runs are bytes (run-major) they are gathered, else one aligned load.
  static_assert(F.k_code_location(8, 0).byte == F.k_code_byte(0, kBits) && F.k_code_location(8, 0).shift == 0 &&
                    F.k_code_location(1, 0).shift == kBits,
                "a K task starts at a byte; token t + 1 sits kBits above token t");
  constexpr bool kRunMajor = F.k_runs_are_bytes();
  static_assert(kRunMajor || (F.k_code_byte(0, 1) == F.k_code_byte(0, 0) + 1 && F.k_channel_bytes() % kBits == 0 &&
                              F.k_code_byte(1, 0) == F.k_code_byte(0, 0) + F.k_channel_bytes()),
                "channel-major K codes: a task's kBits bytes are one aligned load");
#pragma unroll 2
  for (int pass = 0; pass < kTasks / kExtendThreads; ++pass) {
    const int i = tid + pass * kExtendThreads;
    const int c = i / (S / 8);
    const int tc = i % (S / 8);
    uint32_t codes = 0;
    if constexpr (kRunMajor) {
#pragma unroll
      for (int b = 0; b < kBits; ++b) {
        codes |= static_cast<uint32_t>(static_cast<unsigned char>(raw[F.k_code_byte(c, tc * kBits + b)])) << (8 * b);
      }
    } else {
      codes = eight_codes<kBits>(raw + F.k_code_byte(c, tc * kBits));
    }
    const float scale = Elem::widen(*reinterpret_cast<const E*>(raw + F.k_scale_offset(c)));
    const float min = Elem::widen(*reinterpret_cast<const E*>(raw + F.k_min_offset(c)));
    store_eight<E, kBits>(k_tile + c * Tile::kColPitch + tc * 16, codes, scale, min);
  }
  static_assert(F.v_code_location(0, 8).byte == F.v_code_location(0, 0).byte + kBits &&
                    F.v_code_location(1, 0).byte == F.v_code_location(0, 0).byte + F.v_token_bytes() &&
                    F.v_code_location(0, 8).shift == 0 && F.v_code_location(0, 1).shift == kBits &&
                    F.v_token_bytes() % kBits == 0 && F.v_offset() % 4 == 0,
                "V codes: a task's kBits bytes are one aligned load, channel c + 1 kBits above channel c");
#pragma unroll 2
  for (int pass = 0; pass < kTasks / kExtendThreads; ++pass) {
    const int i = tid + pass * kExtendThreads;
    const int t = i / (D / 8);
    const int cc = i % (D / 8);
    const uint32_t codes = eight_codes<kBits>(raw + F.v_code_location(t, 8 * cc).byte);
    const float scale = Elem::widen(*reinterpret_cast<const E*>(raw + F.v_scale_offset(t)));
    const float min = Elem::widen(*reinterpret_cast<const E*>(raw + F.v_min_offset(t)));
    store_eight<E, kBits>(v_tile + t * Tile::kRowPitch + cc * 16, codes, scale, min);
  }
}

// -------------------------------------------------------------- compute --

// One unit of S tokens for the warp's 16 rows. kKChannelMajor: K is
// k_tile[channel][token] (a dequantized block) rather than [token][channel].
// Scores of tokens t > limit[i] are masked for row g + 8 i.
template <typename E, int D, int S, bool kKChannelMajor>
__device__ __forceinline__ void attend_unit(const char* k_tile, const char* v_tile, const char* q_rows,
                                            const uint32_t (&qf)[ExtendTile<D, S>::kQRegs][4], const int (&limit)[2],
                                            float scale_log2, ExtendRows<D>& st, int lane) {
  using Tile = ExtendTile<D, S>;
  constexpr int NT = S / 8;  // n-tiles of 8 tokens
  const int r = lane & 3;

  // ---- S = Q K^T
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    if constexpr (Tile::kQInRegisters) {
      a[0] = qf[ks][0], a[1] = qf[ks][1], a[2] = qf[ks][2], a[3] = qf[ks][3];
    } else {
      // lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15
      ldmatrix_x4(a, q_rows + (lane & 15) * Tile::kRowPitch + (2 * ks + (lane >> 4)) * 16);
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {  // n-tiles 2 np, 2 np + 1
      uint32_t b[4];                       // b0, b1 of n-tile 2 np, then of 2 np + 1
      if constexpr (kKChannelMajor) {
        const int channel = 16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldmatrix_x4_trans(b, k_tile + channel * Tile::kColPitch + (2 * np + (lane >> 4)) * 16);
      } else {
        const int token = 16 * np + (lane & 7) + (lane >> 4) * 8;
        ldmatrix_x4(b, k_tile + token * Tile::kRowPitch + (2 * ks + ((lane >> 3) & 1)) * 16);
      }
      Elem16<E>::mma_16816(s[2 * np], a, b[0], b[1]);
      Elem16<E>::mma_16816(s[2 * np + 1], a, b[2], b[3]);
    }
  }

  // ---- mask, online softmax (base 2)
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = 8 * nt + 2 * r + (e & 1);
      if (token > limit[e >> 1]) s[nt][e] = -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
  }
  float base[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    // fl(max x * scale) is max fl(x * scale): the scale is > 0 and rounding monotonic.
    const float m_new = fmaxf(st.m[i], mx[i] * scale_log2);
    // A row with no valid score yet keeps base 0, so -inf - -inf never occurs.
    base[i] = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2_ftz(st.m[i] - base[i]);
    st.m[i] = m_new;
    st.l[i] *= alpha;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      st.o[nd][2 * i] *= alpha;
      st.o[nd][2 * i + 1] *= alpha;
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = exp2_ftz(fmaf(s[nt][e], scale_log2, -base[e >> 1]));
      st.l[e >> 1] += s[nt][e];
    }
  }

  // ---- O += P V, P as A fragments straight from the S accumulators
#pragma unroll
  for (int kt = 0; kt < S / 16; ++kt) {
    const uint32_t a[4] = {pack2<E>(s[2 * kt][0], s[2 * kt][1]), pack2<E>(s[2 * kt][2], s[2 * kt][3]),
                           pack2<E>(s[2 * kt + 1][0], s[2 * kt + 1][1]), pack2<E>(s[2 * kt + 1][2], s[2 * kt + 1][3])};
    const int token = 16 * kt + (lane & 7) + ((lane >> 3) & 1) * 8;
    const char* v_row = v_tile + token * Tile::kRowPitch;
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {  // channel tiles 2 np, 2 np + 1
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_row + (2 * np + (lane >> 4)) * 16);
      Elem16<E>::mma_16816(st.o[2 * np], a, b[0], b[1]);
      Elem16<E>::mma_16816(st.o[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------- kernel --

template <typename E, int D, int S>
__global__ void __launch_bounds__(kExtendThreads, ExtendTile<D, S>::kMinCtasPerSm)
    paged_extend_kernel(const __grid_constant__ ExtendParams p) {
  using Tile = ExtendTile<D, S>;
  constexpr int M = Tile::kRows;
  extern __shared__ __align__(128) char smem[];
  const int2 range = p.item_range != nullptr ? *p.item_range : p.launch_range;
  if (static_cast<int>(blockIdx.x) >= range.y) return;
  const ExtendWorkItem item = p.items[range.x + blockIdx.x];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int r = lane & 3;
  const int group = p.group;
  const int n0 = item.counts[0];
  const int n01 = n0 + item.counts[1];
  const int nc = n01 + item.counts[2];                   // cached units; new-row units follow
  const int tile_rows = item.n_new * group - item.row0;  // valid rows of the tile (may exceed M)
  // The last new row any row of the tile sees.
  const int j_last = min(item.n_new - 1, (item.row0 + M - 1) / group);

  char* const q_smem = smem;
  auto k_stage = [&](int stage) { return smem + Tile::kQBytes + stage * Tile::kStageBytes; };
  auto v_stage = [&](int stage) { return k_stage(stage) + Tile::kKBytes; };
  auto raw_stage = [&](int stage) { return v_stage(stage) + Tile::kVBytes; };

  // ---- Q tile: row i is (new row j, head h) = ((row0 + i) / group, ...), zero past the tile's rows
  {
    constexpr int kChunks = D / 8;
    constexpr int kRowsPerPass = kExtendThreads / kChunks;
    static_assert(M % kRowsPerPass == 0, "whole passes");
    const int chunk = tid % kChunks;
#pragma unroll
    for (int pass = 0; pass < M / kRowsPerPass; ++pass) {
      const int i = tid / kChunks + pass * kRowsPerPass;
      const int m = item.row0 + i;
      const bool in = i < tile_rows;
      const int j = m / group;
      const std::size_t row =
          in ? (static_cast<std::size_t>(item.q_begin + j) * p.num_q_heads + item.kv_head * group + (m - j * group))
             : 0;
      cp_async_16(q_smem + i * Tile::kRowPitch + chunk * 16, static_cast<const E*>(p.q) + row * D + chunk * 8,
                  in ? 16 : 0);
    }
  }

  const std::size_t table_stride = static_cast<std::size_t>(p.max_sequences) * p.max_blocks;
  const std::int32_t* const table = p.blocks + static_cast<std::size_t>(item.slot) * p.max_blocks;
  const std::size_t kv_row_bytes = static_cast<std::size_t>(p.num_kv_heads) * D * 2;
  // The page id of cached unit u (-1 for new-row units and past the item),
  // looked up one unit before its copies are issued: the load is in flight
  // while the unit before is computed, so no copy waits on the page table.
  auto page_id = [&](int u) -> int {
    if (u >= item.end || u >= nc) return -1;
    if (u < n0) return table[u];
    return u < n01 ? table[table_stride + (u - n0)] : table[2 * table_stride + (u - n01)];
  };
  // Unit u's copies into ring stage `stage` (uniform over the CTA).
  auto issue = [&](int u, int id, int stage) {
    if (u < n0) {
      const char* head = reinterpret_cast<const char*>(p.pools[0].block(id)) +
                         static_cast<std::size_t>(item.kv_head) * Tile::kFp16HeadBytes;
      const int valid = u == n0 - 1 ? item.fill : S;
      load_token_rows<D, S>(k_stage(stage), v_stage(stage), head, head + S * D * 2, D * 2, valid, tid);
    } else if (u < n01) {
      const char* head = reinterpret_cast<const char*>(p.pools[1].block(id)) +
                         static_cast<std::size_t>(item.kv_head) * Tile::kInt4Bytes;
      load_raw_head<Tile::kInt4Bytes>(raw_stage(stage), head, tid);
    } else if (u < nc) {
      const char* head = reinterpret_cast<const char*>(p.pools[2].block(id)) +
                         static_cast<std::size_t>(item.kv_head) * Tile::kInt2Bytes;
      load_raw_head<Tile::kInt2Bytes>(raw_stage(stage), head, tid);
    } else {
      const int t0 = (u - nc) * S;
      const std::size_t first = (static_cast<std::size_t>(item.q_begin + t0) * p.num_kv_heads + item.kv_head) * D;
      load_token_rows<D, S>(
          k_stage(stage), v_stage(stage), reinterpret_cast<const char*>(static_cast<const E*>(p.k) + first),
          reinterpret_cast<const char*>(static_cast<const E*>(p.v) + first), kv_row_bytes, j_last + 1 - t0, tid);
    }
  };

  if (item.begin < item.end) issue(item.begin, page_id(item.begin), 0);
  cp_async_commit();
  int next_id = page_id(item.begin + 1);

  uint32_t qf[Tile::kQRegs][4];
  const char* const q_rows = q_smem + warp * 16 * Tile::kRowPitch;
  if constexpr (Tile::kQInRegisters) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      ldmatrix_x4(qf[ks], q_rows + (lane & 15) * Tile::kRowPitch + (2 * ks + (lane >> 4)) * 16);
    }
  } else {
    qf[0][0] = qf[0][1] = qf[0][2] = qf[0][3] = 0u;
  }

  ExtendRows<D> st;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) st.o[nd][0] = st.o[nd][1] = st.o[nd][2] = st.o[nd][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
  // The causal limit (new row j) of the thread's rows g and g + 8.
  const int row_j[2] = {(item.row0 + 16 * warp + g) / group, (item.row0 + 16 * warp + g + 8) / group};

  int stage = 0;
  for (int u = item.begin; u < item.end; ++u, stage ^= 1) {
    if (u + 1 < item.end) issue(u + 1, next_id, stage ^ 1);
    cp_async_commit();
    next_id = page_id(u + 2);
    cp_async_wait<1>();  // unit u's group (and Q's) landed; u + 1's may be in flight
    __syncthreads();
    if (u < n0) {
      const int last = (u == n0 - 1 ? item.fill : S) - 1;
      const int limit[2] = {last, last};
      attend_unit<E, D, S, false>(k_stage(stage), v_stage(stage), q_rows, qf, limit, p.scale_log2, st, lane);
    } else if (u < nc) {
      if (u < n01) {
        dequantize_block<E, D, S, Precision::INT4>(raw_stage(stage), k_stage(stage), v_stage(stage), tid);
      } else {
        dequantize_block<E, D, S, Precision::INT2>(raw_stage(stage), k_stage(stage), v_stage(stage), tid);
      }
      __syncthreads();
      const int limit[2] = {S - 1, S - 1};
      attend_unit<E, D, S, true>(k_stage(stage), v_stage(stage), q_rows, qf, limit, p.scale_log2, st, lane);
    } else {
      const int t0 = (u - nc) * S;
      const int limit[2] = {row_j[0] - t0, row_j[1] - t0};
      attend_unit<E, D, S, false>(k_stage(stage), v_stage(stage), q_rows, qf, limit, p.scale_log2, st, lane);
    }
    __syncthreads();  // every warp is done with this stage before unit u + 2 is copied into it
  }
  cp_async_wait<0>();

  // ---- normalize and write: the output (E, natural-log LSE) or this piece's partial state
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 1);
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 2);
    const float inv = st.l[i] > 0.0f ? __frcp_rn(st.l[i]) : 0.0f;
    const float lse2 = st.l[i] > 0.0f ? st.m[i] + log2f(st.l[i]) : -INFINITY;
    const int local = 16 * warp + g + 8 * i;
    if (item.partial >= 0) {
      const std::size_t row = static_cast<std::size_t>(item.partial) * M + local;
      float* dst = p.partial_out + row * D + 2 * r;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        *reinterpret_cast<float2*>(dst + 8 * nd) = make_float2(st.o[nd][2 * i] * inv, st.o[nd][2 * i + 1] * inv);
      }
      if (r == 0) p.partial_lse[row] = lse2;
    } else if (local < tile_rows) {
      const int m = item.row0 + local;
      const int j = m / group;
      const std::size_t row =
          static_cast<std::size_t>(item.q_begin + j) * p.num_q_heads + item.kv_head * group + (m - j * group);
      E* dst = static_cast<E*>(p.out) + row * D + 2 * r;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        *reinterpret_cast<typename Elem16<E>::T2*>(dst + 8 * nd) =
            Elem16<E>::round2(st.o[nd][2 * i] * inv, st.o[nd][2 * i + 1] * inv);
      }
      if (r == 0 && p.lse != nullptr) p.lse[row] = lse2 * kLn2;
    }
  }
}

}  // namespace mixkv::gpu::detail
