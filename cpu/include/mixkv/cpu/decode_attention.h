#pragma once
#include <array>
#include <span>

#include "mixkv/core/op_types.h"
#include "mixkv/core/span16.h"
#include "mixkv/cpu/store.h"

namespace mixkv::cpu {

// Decode attention of one layer for a batch, over each sequence's three page
// lists, with GQA (num_q_heads a multiple of num_kv_heads; query head h reads
// KV head h / (num_q_heads / num_kv_heads)). Each pool gives a partial state
// (output, log-sum-exp) and the states are merged exactly (merge_states.h).
//   q:   [batch][num_q_heads][head_dim] of the cache's 16-bit type (the
//        pools' format.dtype, FP16 or BF16)
//   out: [batch][num_q_heads][head_dim] float
//   lse: [batch][num_q_heads] float, natural log of sum_t exp(score_t);
//        -inf for a sequence with no tokens (whose output is 0).
// Scores, softmax weights and each block's weighted values are float32
// (AVX2/FMA/F16C where the CPU has them, portable code giving the same bits
// elsewhere), summed across blocks in double; quantized blocks are read
// through their (scale, min) without dequantizing. Within 1e-5 of a float64 attention on the dequantized K/V
// (read_head), which makes this the reference the CUDA kernels are held to
// (the bound: src/decode_compute.h).
// Throws IndexOutOfRange for a page-table block id outside [0, num_blocks)
// of its pool, InvalidArgument for malformed tables, sizes, q of another
// dtype than the cache's, NaN/inf in q, or out, lse and q overlapping;
// nothing is written then.
struct DecodeAttentionArgs {
  Span16 q;
  std::int32_t num_q_heads = 0;
  float sm_scale = 0.0f;                                               // usually 1/sqrt(head_dim)
  const std::array<PagedPoolTable, kNumPrecisions>* tables = nullptr;  // one layer
  PoolViews pools{};
  std::span<float> out;
  std::span<float> lse;
  // Threads to use at most (a small layer uses fewer); 0 or less:
  // MIXKV_NUM_THREADS if set, else std::thread::hardware_concurrency(). The
  // result is the same for any count (each pair's arithmetic is fixed).
  std::int32_t num_threads = 0;
};
void decode_attention(const DecodeAttentionArgs& args);

}  // namespace mixkv::cpu
