#pragma once
// Merge of split-KV partial states inside the decode kernel (no second
// kernel): the last CTA to finish a group of `fan_in` consecutive pieces of
// a (sequence, KV head) merges the group into the group's first row; the
// last group merger merges the groups into the output. Two levels of about
// sqrt(pieces) rows each keep every merge to a few rows (one round of
// independent L2 loads) where one CTA merging all ~93 pieces of a batch-1
// pair would stream ~330 KB through one SM. Arrival counters sit in fixed
// buffers and are reset by their last arrival, so a run needs no memset and
// a captured graph can be replayed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_params.cuh"
#include "elem16.cuh"

namespace mixkv::gpu::detail {

// Counts this CTA's arrival at `counter`; true in every thread of the CTA
// that arrives `expected`-th. The barrier orders the CTA's earlier writes
// before thread 0's acquire-release add, which publishes them to the last
// arriver (and gives it the others'); its barrier passes that on to all its
// threads. One thread fences instead of all of them, and with acq_rel
// instead of the sequentially consistent fence of __threadfence().
__device__ __forceinline__ bool arrive_last(std::int32_t* counter, int expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    const bool last = before + 1 == expected;
    if (last) *counter = 0;  // every other arrival has counted: reset for the next run
    *flag = last;
  }
  __syncthreads();
  return *flag != 0;
}

// Merges the partial states in rows first + k stride (k < count) into
// partial row `dst_row` (which may be one of the merged rows: each thread
// reads its elements of every row before any thread writes) or, for
// dst_row < 0, into the item's output. Natural-log LSE; empty states
// (lse = -inf) weigh 0 and an all-empty set gives (0, -inf).
// Each thread owns up to kVecs 16-byte vectors of a row (vector i belongs to
// head i / kVecsPerHead) and keeps its own running max and sum, so the lse
// and row loads of a batch of rows go out together: a merge of up to kBatch
// rows is one L2 round trip, with no shared memory and one barrier.
template <typename E, int D, int Threads, int MaxGroup>
__device__ __forceinline__ void merge_rows(const DecodeParams& p, const DecodeWorkItem& item, int first, int stride,
                                           int count, int dst_row) {
  constexpr int kVecsPerHead = D / 4;
  constexpr int kVecs = (MaxGroup * kVecsPerHead + Threads - 1) / Threads;
  constexpr int kBatch = kVecs > 2 ? 4 : 8;  // <= 16 vectors in flight per thread
  const int group = p.group;
  const int vecs = group * kVecsPerHead;
  // Per-thread bases, offset by one product per row. A thread's vectors past
  // the row (i >= vecs) read its last vector instead and discard it, so no
  // load needs a predicate.
  const float4* vec_base[kVecs];
  const float* lse_base[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = min(static_cast<int>(threadIdx.x) + j * Threads, vecs - 1);
    vec_base[j] = reinterpret_cast<const float4*>(p.partial_out) + i;
    lse_base[j] = p.partial_lse + i / kVecsPerHead;
  }
  float4 o[kVecs];
  float mx[kVecs], sum[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    o[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    mx[j] = -INFINITY;
    sum[j] = 0.0f;
  }
  for (int k0 = 0; k0 < count; k0 += kBatch) {
    float lse[kBatch][kVecs];
    float4 x[kBatch][kVecs];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      // Past the last row: load the last row again (an L2 hit) and weigh it 0.
      const bool real = k0 + b < count;
      const std::size_t row = static_cast<std::size_t>(first + min(k0 + b, count - 1) * stride);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        x[b][j] = __ldcg(vec_base[j] + row * vecs);
        const float l = __ldcg(lse_base[j] + row * group);
        lse[b][j] = real ? l : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      float m = mx[j];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) m = fmaxf(m, lse[b][j]);
      // Branch-free (a branch here lets the compiler sink vector j's loads
      // into it, behind vector j - 1's arithmetic): while every state so far
      // is empty, m_ref = 0 makes every weight exp(-inf) = 0.
      const float m_ref = m == -INFINITY ? 0.0f : m;
      const float rescale = __expf(mx[j] - m_ref);  // 0 while mx is -inf
      sum[j] *= rescale;
      o[j].x *= rescale;
      o[j].y *= rescale;
      o[j].z *= rescale;
      o[j].w *= rescale;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const float w = __expf(lse[b][j] - m_ref);
        sum[j] += w;
        o[j].x += w * x[b][j].x;
        o[j].y += w * x[b][j].y;
        o[j].z += w * x[b][j].z;
        o[j].w += w * x[b][j].w;
      }
      mx[j] = m;
    }
  }
  __syncthreads();  // a head's lse is read by every thread of the head before its owner overwrites it
  const std::size_t out_row = static_cast<std::size_t>(item.seq) * p.num_q_heads + item.q_head;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + j * Threads;
    if (i >= vecs) continue;
    const int h = i / kVecsPerHead;
    const float inv = sum[j] > 0.0f ? __frcp_rn(sum[j]) : 0.0f;
    const float4 value = make_float4(o[j].x * inv, o[j].y * inv, o[j].z * inv, o[j].w * inv);
    std::size_t lse_at;
    float* lse;
    if (dst_row >= 0) {
      reinterpret_cast<float4*>(p.partial_out)[static_cast<std::size_t>(dst_row) * vecs + i] = value;
      lse = p.partial_lse;
      lse_at = static_cast<std::size_t>(dst_row) * group + h;
    } else {
      auto* dst =
          reinterpret_cast<typename Elem16<E>::T2*>(values16<E>(p.out) + (out_row + h) * D + (i % kVecsPerHead) * 4);
      dst[0] = Elem16<E>::round2(value.x, value.y);
      dst[1] = Elem16<E>::round2(value.z, value.w);
      lse = p.lse;
      lse_at = out_row + h;
    }
    if (i % kVecsPerHead == 0 && lse != nullptr) lse[lse_at] = sum[j] > 0.0f ? mx[j] + logf(sum[j]) : -INFINITY;
  }
}

// Called by every CTA of a split item after it wrote its partial row.
// `flag`: one int of shared memory no thread still reads.
template <typename E, int D, int Threads, int MaxGroup>
__device__ __forceinline__ void merge_split_item(const DecodeParams& p, const DecodeWorkItem& item, int* flag) {
  const int piece = item.partial - item.first;
  const int group_first = item.first + piece / item.fan_in * item.fan_in;
  const int group_size = min(item.fan_in, item.first + item.pieces - group_first);
  const int groups = (item.pieces + item.fan_in - 1) / item.fan_in;
  if (!arrive_last(p.group_counters + group_first, group_size, flag)) return;
  // One call site for both levels keeps a single inlined copy of the merge.
  int first = group_first, stride = 1, count = group_size, dst_row = groups == 1 ? -1 : group_first;
  for (;;) {
    merge_rows<E, D, Threads, MaxGroup>(p, item, first, stride, count, dst_row);
    if (dst_row < 0 || !arrive_last(p.pair_counters + item.first, groups, flag)) return;
    first = item.first;
    stride = item.fan_in;
    count = groups;
    dst_row = -1;
  }
}

}  // namespace mixkv::gpu::detail
