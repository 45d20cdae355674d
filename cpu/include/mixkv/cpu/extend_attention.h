#pragma once
#include <array>
#include <cstdint>
#include <span>

#include "mixkv/core/op_types.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/span16.h"

namespace mixkv::cpu {

// Extend attention of one layer: a batch of sequences, sequence i bringing
// n_i >= 1 new query rows (rows qo_indptr[i] .. qo_indptr[i+1] of q, k, v,
// FlashInfer's ragged layout). New row j of sequence i attends to
//   - every cached token of sequence i, in its FP16, INT4 and INT2 page lists
//     (tables[p], batch entry i; no mask: the cache holds only tokens that
//     precede the new rows), and
//   - the new rows j' <= j of sequence i (causal), read from k and v, which
//     are not in the cache yet (the caller stores them afterwards).
// Each part gives a partial state (output, log-sum-exp) and the states merge
// exactly (merge_states.h), so decode is the n_i = 1 case: attending one
// row over the cache plus itself is what append-then-decode computes.
// GQA: query head h reads KV head h / (num_q_heads / num_kv_heads).
//   qo_indptr: [batch + 1], qo_indptr[0] = 0, strictly increasing (n_i >= 1),
//              qo_indptr[batch] = rows
//   q:   [rows][num_q_heads][head_dim] of the cache's 16-bit type (the
//        pools' format.dtype, FP16 or BF16), as k and v
//   k,v: [rows][num_kv_heads][head_dim], the new rows' keys and values
//   out: [rows][num_q_heads][head_dim] float
//   lse: [rows][num_q_heads] float, natural log (never -inf: a row always
//        sees itself)
// Arithmetic: each block (the new rows count as blocks of block_size rows)
// is dequantized (read_head) or widened once for a tile of rows x the KV
// head's query heads; scores, softmax weights and the block's weighted
// values are float32 (AVX2/FMA/F16C where the CPU has them, portable code
// giving the same bits elsewhere), summed across blocks in double. Each page
// list and the new rows are cut into chunks of ~256 tokens, fixed by the
// shape, whose states merge in double in a fixed order: the result is the
// same for any thread count. Within 1e-5 of a float64 attention over the
// dequantized K/V (read_head) and the new rows. This is the reference
// the CUDA extend kernel is held to.
// Throws InvalidArgument naming the argument for a qo_indptr that is not
// strictly increasing from 0 to rows (rows = q.size() / (num_q_heads *
// head_dim)), a table whose batch differs from qo_indptr's or that is
// malformed as for decode_attention, q, k or v of another dtype than the
// cache's, sizes that do not match, num_q_heads
// not a positive multiple of num_kv_heads, NaN/inf in q, k or v, and out or
// lse overlapping each other or the inputs; IndexOutOfRange for a block id
// outside [0, num_blocks) of its pool; nothing is written then.
struct ExtendAttentionArgs {
  std::span<const std::int32_t> qo_indptr;
  Span16 q;
  Span16 k;
  Span16 v;
  std::int32_t num_q_heads = 0;
  float sm_scale = 0.0f;                                               // usually 1/sqrt(head_dim)
  const std::array<PagedPoolTable, kNumPrecisions>* tables = nullptr;  // one layer, batch entries
  PoolViews pools{};
  std::span<float> out;
  std::span<float> lse;
  // Threads to use at most; 0 or less: MIXKV_NUM_THREADS if set, else
  // std::thread::hardware_concurrency(). The result is the same for any
  // count.
  std::int32_t num_threads = 0;
};
void extend_attention(const ExtendAttentionArgs& args);

}  // namespace mixkv::cpu
