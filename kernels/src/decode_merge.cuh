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
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_params.cuh"

namespace mixkv::gpu::detail {

// Counts this CTA's arrival at `counter`; true in every thread of the CTA
// that arrives `expected`-th. The CTA's earlier global writes are visible to
// that CTA before it reads them (fence before the count, L2 loads after).
__device__ __forceinline__ bool arrive_last(std::int32_t* counter, int expected, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1) + 1 == expected;
    if (last) *counter = 0;  // every other arrival has counted: reset for the next run
    *flag = last;
  }
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

// Merges the partial states in rows first + k stride (k < count) into
// partial row `dst_row` (which must be `first`: each thread reads its
// elements of every row before it overwrites them) or, for dst_row < 0,
// into the item's output. Natural-log LSE; empty states (lse = -inf) weigh
// 0 and an all-empty set gives (0, -inf). `smem` holds count * MaxGroup + 2
// MaxGroup floats; partial rows are read through L2 (written by other SMs).
template <int D, int Threads, int MaxGroup>
__device__ __forceinline__ void merge_rows(const DecodeParams& p, const DecodeWorkItem& item, int first, int stride,
                                           int count, int dst_row, float* smem) {
  const int group = p.group;
  float* weight = smem;                          // [count][MaxGroup]: lse, then exp(lse - max)
  float* head_max = weight + count * MaxGroup;   // [MaxGroup]
  float* head_sum = head_max + MaxGroup;         // [MaxGroup]
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  for (int h = warp; h < group; h += Threads / 32) {
    float mx = -INFINITY;
    for (int k = lane; k < count; k += 32) {
      const float l = __ldcg(p.partial_lse + static_cast<std::size_t>(first + k * stride) * group + h);
      weight[k * MaxGroup + h] = l;
      mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    float sum = 0.0f;
    for (int k = lane; k < count; k += 32) {  // the same lane rewrites what it wrote
      const float w = mx == -INFINITY ? 0.0f : __expf(weight[k * MaxGroup + h] - mx);
      weight[k * MaxGroup + h] = w;
      sum += w;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      head_max[h] = mx;
      head_sum[h] = sum;
    }
  }
  __syncthreads();  // weights published; every lse of the rows has been read
  const std::size_t row_stride = static_cast<std::size_t>(group) * D;
  const std::size_t out_row = static_cast<std::size_t>(item.seq) * p.num_q_heads + item.kv_head * group;
  // Each thread owns up to kVecs 16-byte vectors of a row (vector i of
  // head i / kVecsPerHead) and loads them from 8 rows at a time: a merge of
  // up to 8 rows is one L2 round trip.
  constexpr int kVecsPerHead = D / 4;
  constexpr int kVecs = (MaxGroup * kVecsPerHead + Threads - 1) / Threads;
  const int vecs = group * kVecsPerHead;
  float4 o[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) o[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int k = 0; k < count; ++k) {
    const float4* row = reinterpret_cast<const float4*>(p.partial_out + static_cast<std::size_t>(first + k * stride) * row_stride);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int i = threadIdx.x + j * Threads;
      if (i < vecs) {
        const float4 x = __ldcg(row + i);
        const float w = weight[k * MaxGroup + i / kVecsPerHead];
        o[j].x += w * x.x;
        o[j].y += w * x.y;
        o[j].z += w * x.z;
        o[j].w += w * x.w;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + j * Threads;
    if (i >= vecs) continue;
    const int h = i / kVecsPerHead;
    const float sum = head_sum[h];
    const float4 value = sum > 0.0f ? make_float4(o[j].x / sum, o[j].y / sum, o[j].z / sum, o[j].w / sum)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (dst_row >= 0) {
      reinterpret_cast<float4*>(p.partial_out + static_cast<std::size_t>(dst_row) * row_stride)[i] = value;
    } else {
      __half2* dst = reinterpret_cast<__half2*>(p.out + (out_row + h) * D + (i % kVecsPerHead) * 4);
      dst[0] = __floats2half2_rn(value.x, value.y);
      dst[1] = __floats2half2_rn(value.z, value.w);
    }
  }
  if (static_cast<int>(threadIdx.x) < group) {
    const int h = threadIdx.x;
    const float sum = head_sum[h];
    const float lse = sum > 0.0f ? head_max[h] + logf(sum) : -INFINITY;
    if (dst_row >= 0) {
      p.partial_lse[static_cast<std::size_t>(dst_row) * group + h] = lse;
    } else if (p.lse != nullptr) {
      p.lse[out_row + h] = lse;
    }
  }
}

// Called by every CTA of a split item after it wrote its partial row.
// `smem`: 32 + 34 MaxGroup floats of shared memory no thread still reads
// (the first 32 hold the arrival flag, apart from the merge's weights).
template <int D, int Threads, int MaxGroup>
__device__ __forceinline__ void merge_split_item(const DecodeParams& p, const DecodeWorkItem& item, float* smem) {
  int* flag = reinterpret_cast<int*>(smem);
  float* scratch = smem + 32;
  const int piece = item.partial - item.first;
  const int group_first = item.first + piece / item.fan_in * item.fan_in;
  const int group_size = min(item.fan_in, item.first + item.pieces - group_first);
  const int groups = (item.pieces + item.fan_in - 1) / item.fan_in;
  if (!arrive_last(p.group_counters + group_first, group_size, flag)) return;
  // One call site for both levels keeps a single inlined copy of the merge.
  int first = group_first, stride = 1, count = group_size, dst_row = groups == 1 ? -1 : group_first;
  for (;;) {
    merge_rows<D, Threads, MaxGroup>(p, item, first, stride, count, dst_row, scratch);
    if (dst_row < 0 || !arrive_last(p.pair_counters + item.first, groups, flag)) return;
    first = item.first;
    stride = item.fan_in;
    count = groups;
    dst_row = -1;
  }
}

}  // namespace mixkv::gpu::detail
