#pragma once
#include "mixkv/cpu/decode_attention.h"

namespace mixkv::cpu::detail {

// The arithmetic of decode_attention on arguments it has validated: block
// ids in range, tables well formed, sizes consistent, q finite, outputs
// disjoint from q and from each other.
//
// Work: every (sequence, KV head) pair's blocks are cut, pool by pool, into
// chunks of at most kChunkTokens tokens. One thread computes a chunk for
// all query heads of its KV head, each block read once for the group: in
// float32 (scores, online softmax, each block's weighted values) with double
// running sums. The chunks of a pair are then merged in double, in a fixed
// order. Threads take chunks (or
// whole pairs when there are enough of them) from a shared counter, so the
// result does not depend on how many threads run, nor on the CPU (AVX2 or
// portable code give the same bits, simd.h).
//
// Quantized blocks are never dequantized: with K's per-channel (scale,
// min) and V's per-token ones, and codes centred as c' = code - 2^(bits-1),
// centre = min + 2^(bits-1) scale,
//   q . k_t = sum_c q_c centre_c + sum_c (q_c scale_c) c'_tc
//   sum_t w_t v_tc = sum_t w_t centre_t + sum_t (w_t scale_t) c'_tc,
// so a code costs one multiply-add per query head, as an FP16 value does,
// from a quarter (INT4) or an eighth (INT2) of the bytes. Centring keeps the
// terms as small as the values themselves (min alone can be far larger).
//
// Error (u = 2^-24): a score is a float32 sum of head_dim products (eight
// lanes of head_dim / 8 multiply-adds, then a 3-level tree), off by at most
// (head_dim / 8 + 3) u times the sum of the products' magnitudes; a weight
// exp(score - max) is float32 within 2 ulp plus that score error; a block's
// weighted values (and weight sum) are float32 sums of at most block_size
// terms, off by at most block_size u times the sum of their magnitudes, and
// are added into double accumulators, as are the chunks when merged. So the
// output's relative error stays near u (head_dim / 8 + block_size + 8)
// times the ratio of sum |w v| to |sum w v|, independently of the context
// length. The decode tests hold it to 1e-5 of a float64 attention on the
// same values, and to 1e-6 between placements of the same tokens in other
// pools and orders; against NumPy's float32 on the benchmark data it is
// ~3e-7.
inline constexpr int kChunkTokens = 256;

void decode_compute(const DecodeAttentionArgs& args);

}  // namespace mixkv::cpu::detail
