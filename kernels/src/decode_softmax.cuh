#pragma once
// The decode kernel's online softmax (decode_kernel.cuh): a warp's running
// state over its query heads, kept in the transposed orientation of the
// kernel's MMAs (channels x heads), and the max, rescale and exponentiation
// steps over a unit's scores, base 2, with the rescale skipped while the
// running max moves by less than a slack.
#include <cuda_fp16.h>

#include <cstdint>

#include "device_math.cuh"

namespace mixkv::gpu::detail {

template <int D, int NT>
struct WarpState {
  float acc[NT][D / 16][4];  // O^T fragments of n-tile nt: channel tile cm, heads 8 nt + 2r, 8 nt + 2r + 1
  float m[NT][2];            // running max (base 2) of those heads
  float l[NT][2];            // this thread's part of the softmax sum
  float vb[NT][2];           // this thread's part of sum_t p_t * vmin_t
};

// The maxima of MT m-tiles' values for heads 2r, 2r + 1 of each n-tile
// over this thread's tokens. The maxima over the warp's tokens (across the
// g lanes) are taken only when the running max has to move
// (online_softmax_rescale, quant_rescale), so the shuffles leave the common
// path.
template <int NT, int MT>
__device__ __forceinline__ void thread_max(const float (&s)[NT][MT][4], float (&tm)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    tm[nt][0] = fmaxf(s[nt][0][0], s[nt][0][2]);
    tm[nt][1] = fmaxf(s[nt][0][1], s[nt][0][3]);
#pragma unroll
    for (int mt = 1; mt < MT; ++mt) {
      tm[nt][0] = fmaxf(tm[nt][0], fmaxf(s[nt][mt][0], s[nt][mt][2]));
      tm[nt][1] = fmaxf(tm[nt][1], fmaxf(s[nt][mt][1], s[nt][mt][3]));
    }
  }
}

// Whether any of the thread's maxima exceeds its limit.
template <int NT>
__device__ __forceinline__ bool exceeds(const float (&tm)[NT][2], const float (&limit)[NT][2], float slack) {
  bool any = false;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) any = any || tm[nt][0] > limit[nt][0] + slack || tm[nt][1] > limit[nt][1] + slack;
  return any;
}

// The running max (base 2) moves only when a block's max exceeds it by more
// than this, so the exponents are taken against a stale max and p <= 2^0.5.
// The softmax is unchanged (O, l and the merge share the one base); a
// rescale (alpha for l, vb and all of O^T) happens a few times a sequence
// instead of at every new maximum, which random scores set in ~40% of a
// warp's blocks. 0.5 keeps P' = p * vscale finite for every FP16 V:
// sqrt(2) * (2 * 65504 / 3) < 65504.
inline constexpr float kRescaleSlack = 0.5f;

// Thread maxima -> the maxima over the warp's tokens (the 8 lanes g that
// share a quad position r, i.e. the heads 2r, 2r + 1 of each n-tile).
template <int NT>
__device__ __forceinline__ void warp_max_over_tokens(float (&m)[NT][2]) {
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      m[nt][0] = fmaxf(m[nt][0], __shfl_xor_sync(0xffffffffu, m[nt][0], offset));
      m[nt][1] = fmaxf(m[nt][1], __shfl_xor_sync(0xffffffffu, m[nt][1], offset));
    }
  }
}

// l, vb and O^T of heads 2r, 2r + 1 of each n-tile times alpha (a moved max).
template <int D, int NT>
__device__ __forceinline__ void rescale_state(WarpState<D, NT>& st, const float (&alpha)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    st.l[nt][0] *= alpha[nt][0];
    st.l[nt][1] *= alpha[nt][1];
    st.vb[nt][0] *= alpha[nt][0];
    st.vb[nt][1] *= alpha[nt][1];
#pragma unroll
    for (int cm = 0; cm < D / 16; ++cm) {
      st.acc[nt][cm][0] *= alpha[nt][0];
      st.acc[nt][cm][1] *= alpha[nt][1];
      st.acc[nt][cm][2] *= alpha[nt][0];
      st.acc[nt][cm][3] *= alpha[nt][1];
    }
  }
}

// The running state after an FP16 unit whose thread maxima are tm (scores
// times scale_log2, -inf for masked rows); base is what the unit's
// exponents subtract.
template <int D, int NT>
__device__ __forceinline__ void online_softmax_rescale(const float (&tm)[NT][2], WarpState<D, NT>& st,
                                                       float (&base)[NT][2]) {
  // -inf + slack is -inf: a head's first finite block always moves it.
  if (__any_sync(0xffffffffu, exceeds<NT>(tm, st.m, kRescaleSlack))) {
    float bm[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) bm[nt][0] = tm[nt][0], bm[nt][1] = tm[nt][1];
    warp_max_over_tokens<NT>(bm);
    float alpha[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        bm[nt][j] = fmaxf(st.m[nt][j], bm[nt][j]);
        // A head with no valid score yet keeps base 0, so -inf - -inf never occurs.
        alpha[nt][j] = exp2_ftz(st.m[nt][j] - (bm[nt][j] == -INFINITY ? 0.0f : bm[nt][j]));
      }
    }
    rescale_state<D, NT>(st, alpha);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) st.m[nt][0] = bm[nt][0], st.m[nt][1] = bm[nt][1];
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    base[nt][0] = st.m[nt][0] == -INFINITY ? 0.0f : st.m[nt][0];
    base[nt][1] = st.m[nt][1] == -INFINITY ? 0.0f : st.m[nt][1];
  }
}

// Exponent arguments (base 2, relative to the running max) ->
// probabilities; the softmax sums updated.
template <int NT, int MT, int D>
__device__ __forceinline__ void exponentiate(float (&e)[NT][MT][4], WarpState<D, NT>& st) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      e[nt][mt][0] = exp2_ftz(e[nt][mt][0]);
      e[nt][mt][1] = exp2_ftz(e[nt][mt][1]);
      e[nt][mt][2] = exp2_ftz(e[nt][mt][2]);
      e[nt][mt][3] = exp2_ftz(e[nt][mt][3]);
      st.l[nt][0] += e[nt][mt][0] + e[nt][mt][2];
      st.l[nt][1] += e[nt][mt][1] + e[nt][mt][3];
    }
  }
}

// Unscaled scores -> probabilities (the scale inside the exponent's fma).
template <int NT, int MT, int D>
__device__ __forceinline__ void online_softmax(float (&s)[NT][MT][4], float scale_log2, WarpState<D, NT>& st) {
  float tm[NT][2], base[NT][2];
  thread_max<NT, MT>(s, tm);
  // fl(max x * scale) is max fl(x * scale): scale_log2 > 0 and rounding is
  // monotonic.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) tm[nt][0] *= scale_log2, tm[nt][1] *= scale_log2;
  online_softmax_rescale<D, NT>(tm, st, base);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      s[nt][mt][0] = fmaf(s[nt][mt][0], scale_log2, -base[nt][0]);
      s[nt][mt][1] = fmaf(s[nt][mt][1], scale_log2, -base[nt][1]);
      s[nt][mt][2] = fmaf(s[nt][mt][2], scale_log2, -base[nt][0]);
      s[nt][mt][3] = fmaf(s[nt][mt][3], scale_log2, -base[nt][1]);
    }
  }
  exponentiate<NT, MT>(s, st);
}

// The quantized loop takes its blocks' exponent arguments e straight from
// the scores (quant_block_scores, relative to st.m), so a block's common
// path has no separate scaling of its scores or of their maxima. tm: the
// thread maxima of e. lim: kRescaleSlack, or -inf before the warp's first
// block, when st.m holds 0 in place of -inf (the exponents of that block
// are then its scaled scores) and the block must set the max. -inf is per
// warp: every head of a warp sees the same tokens.
template <int NT, int MT, int D>
__device__ __forceinline__ void quant_rescale(const float (&tm)[NT][2], float& lim, WarpState<D, NT>& st,
                                              float (&e)[NT][MT][4]) {
  bool over = false;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) over = over || tm[nt][0] > lim || tm[nt][1] > lim;
  if (__any_sync(0xffffffffu, over)) {
    float d[NT][2];  // how far each max moves
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) d[nt][0] = tm[nt][0], d[nt][1] = tm[nt][1];
    warp_max_over_tokens<NT>(d);
    const bool first = lim == -INFINITY;
    float alpha[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        d[nt][j] = first ? d[nt][j] : fmaxf(d[nt][j], 0.0f);
        alpha[nt][j] = first ? 0.0f : exp2_ftz(-d[nt][j]);
      }
    }
    rescale_state<D, NT>(st, alpha);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      st.m[nt][0] += d[nt][0];
      st.m[nt][1] += d[nt][1];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        e[nt][mt][0] -= d[nt][0];
        e[nt][mt][1] -= d[nt][1];
        e[nt][mt][2] -= d[nt][0];
        e[nt][mt][3] -= d[nt][1];
      }
    }
    lim = kRescaleSlack;
  }
}

}  // namespace mixkv::gpu::detail
