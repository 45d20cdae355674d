// The GPU planner's kernels: text norms, the text mean, the window rows with
// each window's plan, and the batch majority vote (docs/planner.md, "On the
// GPU"). Results are deterministic: every sum runs in a fixed order; the only
// atomics count arrivals and pick the first error report.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "device_math.cuh"
#include "host_helpers.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/planner/window_rules.h"
#include "similarity_kernels.h"

namespace mixkv::gpu::planner_detail {
namespace {

// text_norm_kernel: a warp a text row, 2 warps a block, so that a prompt's 64
// text rows spread over 32 SMs (the kernel is bound by memory latency, not
// bandwidth); 16 loads a lane in flight, one round for a 3,584-channel FP16
// row (registers are plentiful at 2 warps a block).
constexpr int kTextNormThreads = 64;
constexpr int kTextNormWarps = kTextNormThreads / kWarp;
constexpr int kTextNormLoads = 16;
// text_mean_kernel: text rows a thread reads before it adds any.
constexpr int kTextMeanLoads = 8;
// window_rows_kernel: a warp a row, at most 64 registers so that 4 blocks (32
// warps) share an SM.
constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / kWarp;
constexpr int kRowMinBlocksPerSm = 4;
// 16-byte loads a lane issues before it uses any: 4 KiB a warp, 128 KiB an SM
// at 32 warps, 17 MB on 132 SMs, enough to keep 4.6 TB/s busy for up to
// 3.6 us of memory latency (Little's law). A 3,584-channel FP16 row is 2
// such rounds (the last 2 loads predicated off).
constexpr int kRowLoads = 8;
// Below this a float sum of squares may have lost digits to underflow (the
// CPU planner uses the same bound).
constexpr float kSmallestTrustedSquares = 1e-30f;

template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

// The elements of one 16-byte load, widened to float.
template <typename T>
__device__ __forceinline__ void widen(const uint4& raw, float (&out)[kVecElems<T>]) {
  if constexpr (sizeof(T) == 4) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f;
      if constexpr (std::is_same_v<T, __half>) {
        f = __half22float2(reinterpret_cast<const __half2*>(&raw)[i]);
      } else {
        f = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&raw)[i]);
      }
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// Shared-memory slot of channel c of the text mean u. On the 16-bit vector
// path a lane multiplies 8 channels at once; read as two float4 at 32-byte
// steps, u would put lanes l and l + 4 of a quarter warp on the same banks.
// So channels 8m..8m+3 live in a first plane and 8m+4..8m+7 in a second, and
// lane l reads float4 l of each: conflict-free.
template <typename T, bool kVec>
__device__ __forceinline__ int u_slot(int c, int hidden) {
  if constexpr (kVec && sizeof(T) == 2) {
    return (((c >> 2) & 1) * (hidden >> 3) + (c >> 3)) * 4 + (c & 3);
  } else {
    return c;
  }
}

// Per-lane float sums of one row over the lane's columns: |v|^2 and, with
// kDot, u . v for u in shared memory (laid out by u_slot). kVec: 16-byte
// streaming loads (embeddings are read once; the host checked alignment and
// hidden % kVecElems == 0), in rounds of kLoads issued before any is used
// and predicated past the row's end: each round's loads are in flight
// together by construction, whatever the compiler makes of a runtime trip
// count.
template <typename T, bool kVec, bool kDot, int kLoads>
__device__ __forceinline__ void row_partials(const T* row, const float* u, int hidden, int lane, float& dot,
                                             float& squares) {
  if constexpr (kVec) {
    constexpr int V = kVecElems<T>;
    constexpr int kStep = kWarp * V;  // channels of one warp-wide load
    const auto* u4 = reinterpret_cast<const float4*>(u);
    for (int start = 0; start < hidden; start += kLoads * kStep) {
      uint4 raw[kLoads];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = start + i * kStep + lane * V;
        raw[i] = c < hidden ? __ldcs(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = start + i * kStep + lane * V;
        if (c >= hidden) break;
        float x[V];
        widen<T>(raw[i], x);
#pragma unroll
        for (int e = 0; e < V; ++e) squares = fmaf(x[e], x[e], squares);
        if constexpr (kDot) {
          // u_slot's planes: channels c..c+3 at float4 c / 8 of the first,
          // c+4..c+7 at the same index of the second (16-bit); F32: natural.
          const float4 w0 = V == 8 ? u4[c >> 3] : u4[c >> 2];
          dot = fmaf(w0.x, x[0], dot);
          dot = fmaf(w0.y, x[1], dot);
          dot = fmaf(w0.z, x[2], dot);
          dot = fmaf(w0.w, x[3], dot);
          if constexpr (V == 8) {
            const float4 w1 = u4[(hidden >> 3) + (c >> 3)];
            dot = fmaf(w1.x, x[4], dot);
            dot = fmaf(w1.y, x[5], dot);
            dot = fmaf(w1.z, x[6], dot);
            dot = fmaf(w1.w, x[7], dot);
          }
        }
      }
    }
  } else {
    for (int c = lane; c < hidden; c += kWarp) {
      const float x = to_float(row[c]);
      squares = fmaf(x, x, squares);
      if constexpr (kDot) dot = fmaf(u[c], x, dot);
    }
  }
}

// The same in double, summed over the warp: for rows whose float sums
// overflowed, underflowed or met a NaN / inf.
template <typename T, bool kVec, bool kDot>
__device__ void row_exact(const T* row, const float* u, int hidden, int lane, double& dot, double& squares) {
  double d = 0.0, s = 0.0;
  for (int c = lane; c < hidden; c += kWarp) {
    const double x = to_float(row[c]);
    s += x * x;
    if constexpr (kDot) d += static_cast<double>(u[u_slot<T, kVec>(c, hidden)]) * x;
  }
  dot = warp_sum(d);
  squares = warp_sum(s);
}

__device__ __forceinline__ bool trusted(float dot, float squares) {
  return isfinite(dot) && isfinite(squares) && squares >= kSmallestTrustedSquares;
}

// |v|^2 and (kDot) u . v of one row over a warp, every lane with the same
// values: float sums, or double ones where those cannot be trusted.
template <typename T, bool kVec, bool kDot, int kLoads>
__device__ __forceinline__ void row_sums(const T* row, const float* u, int hidden, int lane, double& dot,
                                         double& squares) {
  float dot_f = 0.0f, squares_f = 0.0f;
  row_partials<T, kVec, kDot, kLoads>(row, u, hidden, lane, dot_f, squares_f);
  dot_f = warp_sum(dot_f);
  squares_f = warp_sum(squares_f);
  dot = dot_f;
  squares = squares_f;
  if (!trusted(dot_f, squares_f)) row_exact<T, kVec, kDot>(row, u, hidden, lane, dot, squares);
}

// status: [flag, request, prompt row, window (-1 for text)]; the first report wins.
__device__ void report_non_finite(int* status, int request, int row, int window) {
  if (atomicCAS(status, 0, 1) == 0) {
    status[1] = request;
    status[2] = row;
    status[3] = window;
  }
}

// Programmatic dependent launch (sm_90). The planner's kernels after the first
// are launched with launch_after(), so their blocks may start while the kernel
// before them runs; grid_dependency_wait() returns once that kernel has
// completed and its writes are visible. Every kernel waits before it reads
// what an earlier one wrote, and every grid has threads that wait, so a
// completed kernel implies that all earlier ones completed. Each kernel lets
// its successor start at once: the successor's blocks then do their
// text-independent part (index loads, L2 prefetch) meanwhile. Without sm_90
// code both are no-ops and the host launches normally
// (dependent_launch_usable()).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for the first `bytes` of a row, a 128-byte line a lane at a time
// (a hint: it changes no result).
__device__ __forceinline__ void prefetch_l2(const void* row, int bytes, int lane) {
  const auto global = static_cast<std::size_t>(__cvta_generic_to_global(row));
  for (int offset = lane * 128; offset < bytes; offset += kWarp * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(global + offset));
  }
}

template <typename T>
__device__ __forceinline__ const T* row_at(const BatchArgs& a, int request, int row) {
  const auto base = reinterpret_cast<const T*>(a.request_base[request]);
  return base + static_cast<long long>(row) * a.hidden;
}

// 1 / |t_j| for every text row (a warp a row), NaN for a row holding a NaN or
// an infinity (text_mean_kernel reports it). Launched normally, so it also
// clears the error word and the arrival counters: every report and arrival
// comes from a later kernel, after its grid_dependency_wait(). Clearing here,
// not after the last arrival, keeps a launch correct after one that failed
// halfway, and in a replayed CUDA graph.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kTextNormThreads) text_norm_kernel(BatchArgs a) {
  allow_dependent_launch();
  if (blockIdx.x == 0 && threadIdx.x < 4) a.status[threadIdx.x] = 0;
  for (int i = blockIdx.x * kTextNormThreads + threadIdx.x; i <= a.num_windows; i += gridDim.x * kTextNormThreads) {
    a.arrivals[i] = 0;
  }
  const int j = blockIdx.x * kTextNormWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (j >= a.num_text) return;  // whole warps leave together
  const T* row = row_at<T>(a, a.text_request[j], a.text_row[j]);
  double unused, squares;
  row_sums<T, kVec, false, kTextNormLoads>(row, nullptr, a.hidden, lane, unused, squares);
  if (lane == 0) {
    a.text_inv_norm[j] = !isfinite(squares) ? CUDART_NAN : (squares > 0.0 ? 1.0 / sqrt(squares) : 0.0);
  }
}

// Channel c of text rows first, first + 8, ... (kTextMeanLoads of them, 0
// past `end`): every row index first, then every value, so that the loads
// take two round trips, not one per row (a value's address needs its index).
template <typename T>
__device__ __forceinline__ void load_text_values(const BatchArgs& a, const T* base, int c, int first, int end,
                                                 float (&x)[kTextMeanLoads]) {
  int rows[kTextMeanLoads];
#pragma unroll
  for (int i = 0; i < kTextMeanLoads; ++i) {
    const int j = first + i * kWarpsPerBlock;
    rows[i] = j < end ? a.text_row[j] : -1;
  }
#pragma unroll
  for (int i = 0; i < kTextMeanLoads; ++i) {
    x[i] = c < a.hidden && rows[i] >= 0 ? to_float(base[static_cast<long long>(rows[i]) * a.hidden + c]) : 0.0f;
  }
}

// u_r = mean_j t_j / |t_j|. A block covers 32 channels of one request; its
// 8 warps take every 8th text row, so each thread's loads are independent and
// in flight together (a thread walking all N rows alone would pay N memory
// latencies). The first kTextMeanLoads rows a thread adds are read before
// waiting for text_norm_kernel (their values do not depend on it): after the
// wait only the norms remain to be read. Per-warp sums meet in shared memory
// in a fixed order: the same input gives the same bits. Rows with a NaN or an
// infinity stay out of u (so that no window is blamed for them) and block 0 of
// the request reports them.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads) text_mean_kernel(BatchArgs a) {
  __shared__ double partial[kWarpsPerBlock][kWarp];
  allow_dependent_launch();
  const int request = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int c = blockIdx.x * kWarp + lane;
  const int begin = a.text_begin[request];
  const int end = a.text_begin[request + 1];
  const auto* base = reinterpret_cast<const T*>(a.request_base[request]);
  float x[kTextMeanLoads];
  int first = begin + warp;
  load_text_values<T>(a, base, c, first, end, x);
  grid_dependency_wait();
  double sum = 0.0;
  while (true) {
#pragma unroll
    for (int i = 0; i < kTextMeanLoads; ++i) {
      const int j = first + i * kWarpsPerBlock;
      if (j < end) {
        const double inverse = a.text_inv_norm[j];
        sum += inverse > 0.0 ? x[i] * inverse : 0.0;
      }
    }
    first += kTextMeanLoads * kWarpsPerBlock;
    if (first >= end) break;
    load_text_values<T>(a, base, c, first, end, x);
  }
  if (blockIdx.x == 0) {
    for (int j = begin + static_cast<int>(threadIdx.x); j < end; j += kBlockThreads) {
      if (isnan(a.text_inv_norm[j])) report_non_finite(a.status, request, a.text_row[j], -1);
    }
  }
  partial[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && c < a.hidden) {
    double total = 0.0;
    for (int w = 0; w < kWarpsPerBlock; ++w) total += partial[w][lane];
    a.text_mean[static_cast<long long>(request) * a.hidden + c] = static_cast<float>(total / (end - begin));
  }
}

// u of `request` into shared memory at u_slot(). Vector path (hidden % 4 == 0
// there, so float4 loads are aligned): kRowLoads float4 loads a thread issued
// before any store, one L2 round trip for a 3,584-channel mean.
template <typename T, bool kVec>
__device__ __forceinline__ void load_text_mean(const BatchArgs& a, int request, float* u) {
  const float* mean = a.text_mean + static_cast<long long>(request) * a.hidden;
  if constexpr (kVec) {
    const auto* mean4 = reinterpret_cast<const float4*>(mean);
    auto* u4 = reinterpret_cast<float4*>(u);
    const int count = a.hidden / 4;
    for (int start = 0; start < count; start += kRowLoads * kRowThreads) {
      float4 v[kRowLoads];
#pragma unroll
      for (int i = 0; i < kRowLoads; ++i) {
        const int q = start + i * kRowThreads + static_cast<int>(threadIdx.x);
        v[i] = q < count ? mean4[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int i = 0; i < kRowLoads; ++i) {
        const int q = start + i * kRowThreads + static_cast<int>(threadIdx.x);
        // Channels 4q..4q+3 share one plane and sit side by side in it.
        if (q < count) u4[u_slot<T, kVec>(4 * q, a.hidden) / 4] = v[i];
      }
    }
  } else {
    for (int c = threadIdx.x; c < a.hidden; c += kRowThreads) u[c] = mean[c];
  }
}

// Eq. 8 as the mean of window w's row terms (in a fixed order: the same bits
// on every run, whichever warp gets here), then the rule of eqs. 10-11 in
// every layer with the host planner's own thresholds, so that a score gets
// the CPU planner's decision exactly. Written to the device arrays and to the
// window's record in mapped host memory: a record is 4 + layers contiguous
// bytes, so one warp store crosses the bus instead of a byte a layer.
__device__ __forceinline__ void plan_window(const BatchArgs& a, int w, int request, int lane) {
  const int local = a.window_local[w];
  const int windows = a.request_windows[request];
  unsigned char* plan = a.precisions + a.plan_offset[request];
  unsigned char* record = a.host_results + kRecordsOffset + static_cast<long long>(w) * a.record_bytes;
  double sum = 0.0;
  // L2 loads: the values were written by other SMs (L1 is not coherent).
  for (int k = lane; k < a.window_size; k += kWarp) sum += __ldcg(a.row_value + w * a.window_size + k);
  const float score = static_cast<float>(warp_sum(sum) / a.window_size);
  if (lane == 0) {
    a.scores[w] = score;
    *reinterpret_cast<float*>(record) = score;
  }
  for (int l = lane; l < a.num_layers; l += kWarp) {
    const auto minimum = static_cast<Precision>(a.min_precision[l]);
    const auto p = static_cast<unsigned char>(window_precision(score, a.thresholds[l], minimum, local == 0));
    plan[static_cast<long long>(l) * windows + local] = p;
    record[sizeof(float) + l] = p;
  }
}

// Lane 0 adds `count` to *counter; every lane gets the new total, and if it
// is `full` every lane fences, so that what the other arrivals published is
// visible to its loads (the threadFenceReduction pattern of the CUDA
// samples). The caller fenced the writes this arrival stands for. Called by
// whole warps.
__device__ __forceinline__ bool arrive_last(int* counter, int count, int full, int lane) {
  int total = 0;
  if (lane == 0) total = atomicAdd(counter, count) + count;
  total = __shfl_sync(0xffffffffu, total, 0);
  if (total != full) return false;
  __threadfence();
  return true;
}

// Eq. 8's per-row term (u . w_k) / |w_k| of every window row of the batch,
// row g = window * S + k, into row_value[g]. The rows are split evenly over
// the blocks (shares differ by one row at most: no window-sized imbalance
// between SMs), a warp a row; a row's value does not depend on the split.
// Before waiting for the text mean, each warp asks L2 for the start of its
// first row: DRAM is idle while the text kernels run, and those lines are the
// first the warp reads after the wait.
// A block counts its rows into each window it touched once all of them are
// written: one fence a warp and one atomic a (block, window), where an
// arrival a row put a fence and an L2 round trip between every two rows of
// a warp. The block that completes a window (arrivals[w] reaches S) plans it
// at once, so no kernel waits for the slowest row of the batch to start the
// sums; the block that completes the last window copies the error word to
// the mapped host results, after every report was made (a report precedes
// its row's arrival; text reports precede this kernel).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads, kRowMinBlocksPerSm) window_rows_kernel(BatchArgs a) {
  extern __shared__ float4 shared4[];
  float* u = reinterpret_cast<float*>(shared4);
  allow_dependent_launch();
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  // int indices: prepare() caps the window rows at 2^31 - 1 (64-bit ones
  // cost the row loop registers and 64-bit divisions).
  const int rows = a.num_windows * a.window_size;
  const int share = rows / static_cast<int>(gridDim.x);
  const int extra = rows % static_cast<int>(gridDim.x);
  const int block = static_cast<int>(blockIdx.x);
  const int begin = block * share + min(block, extra);
  const int end = begin + share + (block < extra ? 1 : 0);
  if (begin + warp < end) {
    const int w = (begin + warp) / a.window_size;
    const int k = begin + warp - w * a.window_size;
    prefetch_l2(row_at<T>(a, a.window_request[w], a.window_row[w] + k), a.prefetch_bytes, lane);
  }
  grid_dependency_wait();
  // A share may span requests (batches): one u at a time.
  for (int first = begin; first < end;) {
    const int request = a.window_request[first / a.window_size];
    const int last = min(end, a.window_begin[request + 1] * a.window_size);
    __syncthreads();  // the previous request's u is no longer read
    load_text_mean<T, kVec>(a, request, u);
    __syncthreads();
    for (int g = first + warp; g < last; g += kRowWarps) {
      const int w = g / a.window_size;
      const int prompt_row = a.window_row[w] + (g - w * a.window_size);
      const T* row = row_at<T>(a, request, prompt_row);
      double dot, squares;
      row_sums<T, kVec, true, kRowLoads>(row, u, a.hidden, lane, dot, squares);
      if (!isfinite(dot) || !isfinite(squares)) {
        if (lane == 0) report_non_finite(a.status, request, prompt_row, a.window_local[w]);
        squares = 0.0;
      }
      if (lane == 0) a.row_value[g] = squares > 0.0 ? dot / sqrt(squares) : 0.0;
    }
    if (lane == 0) __threadfence();  // this warp's row values and reports, before any arrival below
    __syncthreads();
    const int first_window = first / a.window_size;
    for (int w = first_window + warp; w * a.window_size < last; w += kRowWarps) {
      const int count = min(last, (w + 1) * a.window_size) - max(first, w * a.window_size);
      if (!arrive_last(a.arrivals + w, count, a.window_size, lane)) continue;
      plan_window(a, w, request, lane);
      // Only the error word is read after this arrival: the plan's stores
      // are read after the kernel (majority_vote_kernel, the host).
      if (lane == 0) __threadfence();
      if (arrive_last(a.arrivals + a.num_windows, 1, a.num_windows, lane) && lane < 4) {
        reinterpret_cast<int*>(a.host_results)[lane] = __ldcg(a.status + lane);
      }
    }
    first = last;
  }
}

// The paper's per-batch option: a thread per (window position, layer), layers
// adjacent so that the host record stores of a warp are contiguous.
__global__ void majority_vote_kernel(BatchArgs a) {
  grid_dependency_wait();
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(a.num_layers) * a.max_windows) return;
  const int layer = static_cast<int>(index % a.num_layers);
  const int window = static_cast<int>(index / a.num_layers);
  int votes[kNumPrecisions] = {0, 0, 0};
  for (int r = 0; r < a.num_requests; ++r) {
    const int windows = a.request_windows[r];
    if (window < windows) ++votes[a.precisions[a.plan_offset[r] + static_cast<long long>(layer) * windows + window]];
  }
  // Pool indices run from most to least precise: ties go up, as on the CPU.
  int winner = 0;
  for (int p = 1; p < kNumPrecisions; ++p) {
    if (votes[p] > votes[winner]) winner = p;
  }
  for (int r = 0; r < a.num_requests; ++r) {
    const int windows = a.request_windows[r];
    if (window < windows) {
      a.precisions[a.plan_offset[r] + static_cast<long long>(layer) * windows + window] =
          static_cast<unsigned char>(winner);
      const long long w = a.window_begin[r] + window;
      a.host_results[kRecordsOffset + w * a.record_bytes + sizeof(float) + layer] = static_cast<unsigned char>(winner);
    }
  }
}

// Stream-ordered after the previous kernel, with programmatic dependent launch
// where `dependent` (see grid_dependency_wait()).
template <typename Kernel>
void launch_after(bool dependent, Kernel kernel, dim3 grid, dim3 block, std::size_t shared, cudaStream_t stream,
                  const BatchArgs& args, const char* name) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = dependent ? &attribute : nullptr;
  config.numAttrs = dependent ? 1 : 0;
  detail::check_cuda(cudaLaunchKernelEx(&config, kernel, args), name, __FILE__, __LINE__);
}

template <typename T, bool kVec>
void launch_planner_kernels(const BatchArgs& args, const RowLaunch& rows, bool dependent, bool vote,
                            cudaStream_t stream) {
  // A normal launch: it waits for the work list's upload and for whatever
  // the caller queued before.
  text_norm_kernel<T, kVec>
      <<<(args.num_text + kTextNormWarps - 1) / kTextNormWarps, kTextNormThreads, 0, stream>>>(args);
  MIXKV_CUDA_CHECK_LAUNCH("text_norm_kernel");
  const dim3 mean_grid((args.hidden + kWarp - 1) / kWarp, args.num_requests);
  launch_after(dependent, text_mean_kernel<T>, mean_grid, kBlockThreads, 0, stream, args, "launch of text_mean_kernel");
  if (args.num_windows == 0) return;
  launch_after(dependent, window_rows_kernel<T, kVec>, rows.grid, kRowThreads, rows.shared, stream, args,
               "launch of window_rows_kernel");
  if (vote && args.num_requests > 1) {
    const long long threads = static_cast<long long>(args.num_layers) * args.max_windows;
    launch_after(dependent, majority_vote_kernel, static_cast<unsigned>((threads + kBlockThreads - 1) / kBlockThreads),
                 kBlockThreads, 0, stream, args, "launch of majority_vote_kernel");
  }
}

// Calls f.template operator()<T, kVec>() for an element type and load path.
template <typename F>
decltype(auto) with_types(ElementType type, bool vectorized, F&& f) {
  switch (type) {
    case ElementType::F32:
      return vectorized ? f.template operator()<float, true>() : f.template operator()<float, false>();
    case ElementType::F16:
      return vectorized ? f.template operator()<__half, true>() : f.template operator()<__half, false>();
    case ElementType::BF16:
      return vectorized ? f.template operator()<__nv_bfloat16, true>() : f.template operator()<__nv_bfloat16, false>();
  }
  throw InvalidArgument("embeddings type = " + std::to_string(static_cast<int>(type)) +
                        ", expected F32 (0), F16 (1) or BF16 (2)");
}

}  // namespace

RowLaunch plan_row_launch(ElementType type, bool vectorized, std::int32_t hidden, std::size_t window_rows, int sms,
                          int l2_bytes) {
  RowLaunch launch;
  if (window_rows == 0) return launch;
  const std::size_t shared = align16(static_cast<std::size_t>(hidden) * 4);
  const int per_sm = with_types(type, vectorized, [&]<typename T, bool kVec>() {
    if (shared > 48 * 1024) {
      MIXKV_CUDA_CHECK(cudaFuncSetAttribute(window_rows_kernel<T, kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared)));
    }
    int blocks = 0;
    MIXKV_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, window_rows_kernel<T, kVec>, kRowThreads, shared));
    return blocks;
  });
  if (per_sm < 1) {
    throw DeviceError("window_rows_kernel fits no SM with " + std::to_string(shared) + " bytes of shared memory");
  }
  launch.grid = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(per_sm) * sms, window_rows));
  launch.shared = shared;
  // Prefetched rows must still be in L2 when read, so the warps share half
  // of it (up to a whole first row each). The other half holds the text
  // stage's few lines and the lines streamed after the wait, which the warps
  // read first-evict (__ldcs) and after their prefetched lines.
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * element_bytes(type);
  const std::size_t warps = static_cast<std::size_t>(launch.grid) * kRowWarps;
  launch.prefetch_bytes = static_cast<int>(std::min(row_bytes, static_cast<std::size_t>(l2_bytes) / 2 / warps));
  return launch;
}

bool dependent_launch_usable() {
  int device = 0, major = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attributes{};
  MIXKV_CUDA_CHECK(cudaFuncGetAttributes(&attributes, majority_vote_kernel));
  return major >= 9 && attributes.binaryVersion >= 90;
}

void launch_similarity_kernels(ElementType type, bool vectorized, const BatchArgs& args, const RowLaunch& rows,
                               bool dependent, bool vote, cudaStream_t stream) {
  with_types(type, vectorized,
             [&]<typename T, bool kVec>() { launch_planner_kernels<T, kVec>(args, rows, dependent, vote, stream); });
}

}  // namespace mixkv::gpu::planner_detail
