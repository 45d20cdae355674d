#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "mixkv/core/errors.h"
#include "mixkv/planner/window_rules.h"
#include "mixkv/planner/cuda_window_planner.h"

namespace mixkv::gpu {
namespace {

// ---------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------

void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  const std::string message =
      std::string(what) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
  if (status == cudaErrorMemoryAllocation) throw OutOfMemory(message);
  throw DeviceError(message);
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw DeviceError(std::string(what) + " failed: cuBLAS status " + std::to_string(static_cast<int>(status)));
}

#define MIXKV_PLANNER_CUDA(call) check_cuda((call), #call)
#define MIXKV_PLANNER_LAUNCHED(name) check_cuda(cudaGetLastError(), "launch of " name)

constexpr std::size_t align16(std::size_t n) { return (n + 15) & ~std::size_t{15}; }
constexpr std::size_t align4(std::size_t n) { return (n + 3) & ~std::size_t{3}; }

// Carves one allocation into 16-byte aligned arrays.
struct Carver {
  std::size_t total = 0;
  std::size_t add(std::size_t bytes) {
    const std::size_t offset = total;
    total = align16(total + bytes);
    return offset;
  }
};

// Device memory that grows in stream order and is never shrunk.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);  // waits for the device: the buffer may still be read
  }
  void reserve(std::size_t bytes, cudaStream_t stream) {
    if (bytes <= bytes_) return;
    if (ptr_ != nullptr) MIXKV_PLANNER_CUDA(cudaFreeAsync(ptr_, stream));
    ptr_ = nullptr;
    bytes_ = 0;
    MIXKV_PLANNER_CUDA(cudaMallocAsync(&ptr_, bytes, stream));
    bytes_ = bytes;
  }
  std::byte* get() const { return static_cast<std::byte*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory, so that copies are truly asynchronous; with
// cudaHostAllocMapped also written by kernels directly. Only grown while no
// copy or kernel uses it (the planner's state machine ensures it).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(unsigned flags = cudaHostAllocDefault) : flags_(flags) {}
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  void reserve(std::size_t bytes) {
    if (bytes <= bytes_) return;
    if (ptr_ != nullptr) MIXKV_PLANNER_CUDA(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    bytes_ = 0;
    device_ = nullptr;
    MIXKV_PLANNER_CUDA(cudaHostAlloc(&ptr_, bytes, flags_));
    if ((flags_ & cudaHostAllocMapped) != 0) MIXKV_PLANNER_CUDA(cudaHostGetDevicePointer(&device_, ptr_, 0));
    bytes_ = bytes;
  }
  std::byte* get() const { return static_cast<std::byte*>(ptr_); }
  // The device's address of a cudaHostAllocMapped buffer.
  std::byte* device() const { return static_cast<std::byte*>(device_); }

 private:
  unsigned flags_;
  void* ptr_ = nullptr;
  void* device_ = nullptr;
  std::size_t bytes_ = 0;
};

template <typename T>
T* at_offset(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

std::size_t element_bytes(ElementType type) { return type == ElementType::F32 ? 4 : 2; }

// 16-byte loads need every row to start on a 16-byte boundary.
bool rows_aligned(std::span<const EmbeddingsView> views) {
  for (const EmbeddingsView& v : views) {
    if (reinterpret_cast<std::uintptr_t>(v.data) % 16 != 0) return false;
    if (static_cast<std::size_t>(v.hidden) * element_bytes(v.type) % 16 != 0) return false;
  }
  return true;
}

std::string indexed(const char* name, std::size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

void require_one_type(std::span<const EmbeddingsView> views, const char* name) {
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (views[i].type != views[0].type) {
      throw InvalidArgument(indexed(name, i) + ".type = " + std::to_string(static_cast<int>(views[i].type)) +
                            ", expected " + std::to_string(static_cast<int>(views[0].type)) + " as " + name +
                            "[0] (one element type per batch on the GPU)");
    }
  }
}

// ---------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------

constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarp;
// text_norm_kernel: a warp a text row, 2 warps a block, so that a prompt's 64
// text rows spread over 32 SMs (8 blocks of 8 warps left the kernel latency
// bound on 8 SMs); 16 loads a lane in flight, one round for a 3,584-channel
// FP16 row (registers are plentiful at 2 warps a block).
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
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

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

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the bit-identical total, so branches on
  // it are warp-uniform.
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
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
// code both are no-ops and the host launches normally (pdl_usable()).
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

// ---------------------------------------------------------------------------
// Kernels of the planner
// ---------------------------------------------------------------------------

// Mapped host results: the error word (4 ints), then the windows' records.
constexpr std::size_t kRecordsOffset = 4 * sizeof(int);

struct BatchArgs {
  const unsigned long long* request_base;  // [requests] address of row 0
  const long long* plan_offset;            // [requests] first precision of the request
  const int* text_begin;                   // [requests + 1] CSR over text rows
  const int* window_begin;                 // [requests + 1] CSR over windows
  const int* request_windows;              // [requests]
  const int* text_row;                     // [text rows] prompt position
  const int* text_request;                 // [text rows]
  const int* window_row;                   // [windows] prompt position of the first token
  const int* window_request;               // [windows]
  const int* window_local;                 // [windows] index inside its request
  const LayerThresholds* thresholds;       // [layers] the host planner's
  const unsigned char* min_precision;      // [layers]
  double* text_inv_norm;                   // [text rows] scratch; NaN: the row is not finite
  float* text_mean;                        // [requests][hidden] scratch
  double* row_value;                       // [windows][window_size] scratch: (u . w) / |w|
  int* arrivals;                           // [windows + 1] rows done per window, then windows done
  float* scores;                           // [windows]
  unsigned char* precisions;               // per request [layers][windows]
  int* status;                             // [4]
  unsigned char* host_results;             // mapped pinned: status [4], then a record a window
  int record_bytes;                        // a window's record: float score, a precision a layer
  int num_text;
  int num_windows;
  int hidden;
  int window_size;
  int num_layers;
  int max_windows;
  int num_requests;
  int prefetch_bytes;  // of each warp's first window row, before the text mean is known
};

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

// Launch geometry of window_rows_kernel, fixed in prepare() so that launch()
// only enqueues.
struct RowLaunch {
  int grid = 0;
  std::size_t shared = 0;
};

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
  check_cuda(cudaLaunchKernelEx(&config, kernel, args), name);
}

template <typename T, bool kVec>
void launch_planner_kernels(const BatchArgs& args, const RowLaunch& rows, bool dependent, bool vote,
                            cudaStream_t stream) {
  // A normal launch: it waits for the work list's upload and for whatever
  // the caller queued before.
  text_norm_kernel<T, kVec>
      <<<(args.num_text + kTextNormWarps - 1) / kTextNormWarps, kTextNormThreads, 0, stream>>>(args);
  MIXKV_PLANNER_LAUNCHED("text_norm_kernel");
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

// Programmatic dependent launch needs an sm_90 device running sm_90 code (the
// kernels' griddepcontrol instructions); otherwise kernels launch normally.
bool pdl_usable() {
  int device = 0, major = 0;
  MIXKV_PLANNER_CUDA(cudaGetDevice(&device));
  MIXKV_PLANNER_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attributes{};
  MIXKV_PLANNER_CUDA(cudaFuncGetAttributes(&attributes, majority_vote_kernel));
  return major >= 9 && attributes.binaryVersion >= 90;
}

// The CUDA planner keeps the text mean in shared memory: 192 KiB at the
// limit, inside an sm_90 block's 227 KiB.
constexpr std::int32_t kMaxHidden = 49152;
// text_mean_kernel puts requests on gridDim.y.
constexpr std::size_t kMaxRequests = 65535;

}  // namespace

// ---------------------------------------------------------------------------
// CudaWindowPlanner
// ---------------------------------------------------------------------------

struct CudaWindowPlanner::Impl {
  enum class State { Idle, Prepared, Launched };

  WindowPlanner host;      // validation, configuration and thresholds
  DeviceBuffer constants;  // thresholds, min precisions
  DeviceBuffer upload;     // the batch's work list
  DeviceBuffer work;       // [scores | status | precisions | arrival counters] then scratch
  PinnedBuffer staging;    // host side of `upload`
  PinnedBuffer results{cudaHostAllocMapped};  // written by the kernels (BatchArgs::host_results)

  State state = State::Idle;
  BatchArgs args{};
  ElementType type = ElementType::F32;
  bool vectorized = false;
  bool dependent_launch = false;  // pdl_usable() on the constructor's device
  int sms = 0;
  int l2_bytes = 0;
  RowLaunch rows;
  std::size_t upload_bytes = 0;
  std::vector<std::int32_t> windows_of;          // per request
  std::vector<std::int64_t> first_window_of;     // per request

  explicit Impl(PlannerConfig config) : host(std::move(config)) {}
};

CudaWindowPlanner::CudaWindowPlanner(PlannerConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {
  Impl& m = *impl_;
  const std::int32_t layers = m.host.num_layers();
  const std::span<const LayerThresholds> thresholds = m.host.thresholds();
  const std::vector<Precision>& min_precision = m.host.config().min_precision;
  const std::size_t o_min = align16(layers * sizeof(LayerThresholds));
  std::vector<std::byte> host(o_min + static_cast<std::size_t>(layers));
  std::memcpy(host.data(), thresholds.data(), layers * sizeof(LayerThresholds));
  for (std::int32_t l = 0; l < layers; ++l) {
    host[o_min + l] =
        static_cast<std::byte>(min_precision.empty() ? pool_index(Precision::INT2) : pool_index(min_precision[l]));
  }
  m.constants.reserve(host.size(), nullptr);
  MIXKV_PLANNER_CUDA(cudaMemcpy(m.constants.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  m.args.thresholds = at_offset<const LayerThresholds>(m.constants.get(), 0);
  m.args.min_precision = at_offset<const unsigned char>(m.constants.get(), o_min);
  m.args.window_size = m.host.config().window_size;
  m.args.num_layers = layers;
  int device = 0;
  MIXKV_PLANNER_CUDA(cudaGetDevice(&device));
  MIXKV_PLANNER_CUDA(cudaDeviceGetAttribute(&m.sms, cudaDevAttrMultiProcessorCount, device));
  MIXKV_PLANNER_CUDA(cudaDeviceGetAttribute(&m.l2_bytes, cudaDevAttrL2CacheSize, device));
  m.dependent_launch = pdl_usable();
}

CudaWindowPlanner::~CudaWindowPlanner() = default;

const PlannerConfig& CudaWindowPlanner::config() const { return impl_->host.config(); }
std::int32_t CudaWindowPlanner::num_layers() const { return impl_->host.num_layers(); }

void CudaWindowPlanner::prepare(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                                cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.state != Impl::State::Idle) {
    throw InvalidArgument("prepare() called while a batch is in flight, expected finish() first");
  }
  const std::int32_t window_size = m.host.config().window_size;
  validate_similarity_inputs(layouts, embeddings, window_size);
  if (layouts.empty()) throw InvalidArgument("layouts is empty, expected at least one request");
  if (layouts.size() > kMaxRequests) {
    throw InvalidArgument("layouts holds " + std::to_string(layouts.size()) + " requests, expected at most " +
                          std::to_string(kMaxRequests) + " a batch");
  }
  require_one_type(embeddings, "embeddings");
  if (embeddings[0].hidden > kMaxHidden) {
    throw InvalidArgument("embeddings[0].hidden = " + std::to_string(embeddings[0].hidden) + ", expected at most " +
                          std::to_string(kMaxHidden) + " on the GPU");
  }

  // The work list, on the host.
  const std::size_t requests = layouts.size();
  const std::int64_t layers = m.host.num_layers();
  std::vector<std::int32_t> text_begin{0}, window_begin{0}, text_row, text_request, window_row, window_request,
      window_local;
  std::vector<std::int32_t> windows_of(requests);
  std::vector<std::int64_t> first_precision_of(requests), first_window_of(requests);
  std::int64_t precisions = 0;
  for (std::size_t r = 0; r < requests; ++r) {
    std::int32_t position = 0;
    for (const Segment& s : layouts[r].segments()) {
      if (s.kind == TokenKind::Text) {
        for (std::int32_t t = position; t < position + s.length; ++t) {
          text_row.push_back(t);
          text_request.push_back(static_cast<std::int32_t>(r));
        }
      }
      position += s.length;
    }
    text_begin.push_back(static_cast<std::int32_t>(text_row.size()));
    const std::vector<std::int32_t> starts = layouts[r].window_starts(window_size);
    first_window_of[r] = static_cast<std::int64_t>(window_row.size());
    for (std::size_t i = 0; i < starts.size(); ++i) {
      window_row.push_back(starts[i]);
      window_request.push_back(static_cast<std::int32_t>(r));
      window_local.push_back(static_cast<std::int32_t>(i));
    }
    windows_of[r] = static_cast<std::int32_t>(starts.size());
    window_begin.push_back(static_cast<std::int32_t>(window_row.size()));
    first_precision_of[r] = precisions;
    precisions += layers * windows_of[r];
  }
  if (text_row.size() > static_cast<std::size_t>(INT32_MAX) ||
      window_row.size() * static_cast<std::size_t>(window_size) > static_cast<std::size_t>(INT32_MAX)) {
    throw InvalidArgument("the batch holds more than 2^31 - 1 text rows or window rows, expected fewer");
  }

  Carver in;
  const std::size_t o_base = in.add(requests * 8);
  const std::size_t o_plan = in.add(requests * 8);
  const std::size_t o_text_begin = in.add((requests + 1) * 4);
  const std::size_t o_window_begin = in.add((requests + 1) * 4);
  const std::size_t o_windows = in.add(requests * 4);
  const std::size_t o_text_row = in.add(text_row.size() * 4);
  const std::size_t o_text_request = in.add(text_row.size() * 4);
  const std::size_t o_window_row = in.add(window_row.size() * 4);
  const std::size_t o_window_request = in.add(window_row.size() * 4);
  const std::size_t o_window_local = in.add(window_row.size() * 4);

  const std::int32_t hidden = embeddings[0].hidden;
  Carver out;
  const std::size_t o_scores = out.add(window_row.size() * 4);
  const std::size_t o_status = out.add(16);
  const std::size_t o_precisions = out.add(static_cast<std::size_t>(precisions));
  const std::size_t o_arrivals = out.add((window_row.size() + 1) * 4);
  const std::size_t o_inv_norm = out.add(text_row.size() * 8);
  const std::size_t o_mean = out.add(requests * static_cast<std::size_t>(hidden) * 4);
  const std::size_t window_rows = window_row.size() * static_cast<std::size_t>(window_size);
  const std::size_t o_row_value = out.add(window_rows * 8);

  m.staging.reserve(in.total);
  const std::size_t record_bytes = sizeof(float) + static_cast<std::size_t>(align4(layers));
  m.results.reserve(kRecordsOffset + window_row.size() * record_bytes);
  m.upload.reserve(in.total, stream);
  m.work.reserve(out.total, stream);

  std::byte* h = m.staging.get();
  for (std::size_t r = 0; r < requests; ++r) {
    at_offset<unsigned long long>(h, o_base)[r] = reinterpret_cast<std::uintptr_t>(embeddings[r].data);
    at_offset<long long>(h, o_plan)[r] = first_precision_of[r];
  }
  const auto put = [&](std::size_t offset, const std::vector<std::int32_t>& v) {
    if (!v.empty()) std::memcpy(h + offset, v.data(), v.size() * 4);
  };
  put(o_text_begin, text_begin);
  put(o_window_begin, window_begin);
  put(o_windows, windows_of);
  put(o_text_row, text_row);
  put(o_text_request, text_request);
  put(o_window_row, window_row);
  put(o_window_request, window_request);
  put(o_window_local, window_local);
  MIXKV_PLANNER_CUDA(cudaMemcpyAsync(m.upload.get(), h, in.total, cudaMemcpyHostToDevice, stream));

  std::byte* d = m.upload.get();
  std::byte* wk = m.work.get();
  BatchArgs& a = m.args;
  a.request_base = at_offset<const unsigned long long>(d, o_base);
  a.plan_offset = at_offset<const long long>(d, o_plan);
  a.text_begin = at_offset<const int>(d, o_text_begin);
  a.window_begin = at_offset<const int>(d, o_window_begin);
  a.request_windows = at_offset<const int>(d, o_windows);
  a.text_row = at_offset<const int>(d, o_text_row);
  a.text_request = at_offset<const int>(d, o_text_request);
  a.window_row = at_offset<const int>(d, o_window_row);
  a.window_request = at_offset<const int>(d, o_window_request);
  a.window_local = at_offset<const int>(d, o_window_local);
  a.scores = at_offset<float>(wk, o_scores);
  a.status = at_offset<int>(wk, o_status);
  a.precisions = at_offset<unsigned char>(wk, o_precisions);
  a.text_inv_norm = at_offset<double>(wk, o_inv_norm);
  a.text_mean = at_offset<float>(wk, o_mean);
  a.row_value = at_offset<double>(wk, o_row_value);
  a.arrivals = at_offset<int>(wk, o_arrivals);
  a.host_results = reinterpret_cast<unsigned char*>(m.results.device());
  a.record_bytes = static_cast<int>(record_bytes);
  a.num_text = static_cast<int>(text_row.size());
  a.num_windows = static_cast<int>(window_row.size());
  a.hidden = hidden;
  a.max_windows = *std::max_element(windows_of.begin(), windows_of.end());
  a.num_requests = static_cast<int>(requests);

  m.type = embeddings[0].type;
  m.vectorized = rows_aligned(embeddings);
  if (window_rows > 0) {
    // Every block resident at once, none without a row.
    const std::size_t shared = align16(static_cast<std::size_t>(hidden) * 4);
    const int per_sm = with_types(m.type, m.vectorized, [&]<typename T, bool kVec>() {
      if (shared > 48 * 1024) {
        MIXKV_PLANNER_CUDA(cudaFuncSetAttribute(window_rows_kernel<T, kVec>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
      }
      int blocks = 0;
      MIXKV_PLANNER_CUDA(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, window_rows_kernel<T, kVec>, kRowThreads, shared));
      return blocks;
    });
    if (per_sm < 1) {
      throw DeviceError("window_rows_kernel fits no SM with " + std::to_string(shared) + " bytes of shared memory");
    }
    m.rows.grid = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(per_sm) * m.sms, window_rows));
    m.rows.shared = shared;
    // Prefetched rows must still be in L2 when read: half of it, shared by
    // all warps (up to a whole first row each: 30 MB at 132 SMs and 7 KB
    // rows, ~6.5 us of DRAM time, about as long as the text kernels are
    // estimated to take; it was a third, 17 MB, before). The other
    // half holds the text stage's few lines and the lines streamed after the
    // wait, which the warps read first-evict (__ldcs) and after their
    // prefetched lines.
    const std::size_t row_bytes = static_cast<std::size_t>(hidden) * element_bytes(m.type);
    const std::size_t warps = static_cast<std::size_t>(m.rows.grid) * kRowWarps;
    a.prefetch_bytes = static_cast<int>(std::min(row_bytes, static_cast<std::size_t>(m.l2_bytes) / 2 / warps));
  }
  m.upload_bytes = in.total;
  m.windows_of = std::move(windows_of);
  m.first_window_of = std::move(first_window_of);
  m.state = Impl::State::Prepared;
}

void CudaWindowPlanner::launch(cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.state != Impl::State::Prepared) {
    throw InvalidArgument(m.state == Impl::State::Idle ? "launch() without a prepared batch, expected prepare() first"
                                                       : "launch() called twice, expected finish() first");
  }
  const bool vote = m.host.config().batch_policy == BatchPolicy::MajorityVote;
  // Dependent launches only on streams the caller created; the special
  // handles (legacy and per-thread default stream) launch normally, a case
  // nobody has tried with programmatic dependent launch here.
  const bool dependent =
      m.dependent_launch && stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread;
  with_types(m.type, m.vectorized, [&]<typename T, bool kVec>() {
    launch_planner_kernels<T, kVec>(m.args, m.rows, dependent, vote, stream);
  });
  // Without windows no kernel copies the error word to the host results.
  if (m.args.num_windows == 0) {
    MIXKV_PLANNER_CUDA(
        cudaMemcpyAsync(m.results.get(), m.args.status, kRecordsOffset, cudaMemcpyDeviceToHost, stream));
  }
  m.state = Impl::State::Launched;
}

std::vector<PrecisionPlan> CudaWindowPlanner::finish(cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.state != Impl::State::Launched) {
    throw InvalidArgument("finish() without a launched batch, expected prepare() and launch() first");
  }
  m.state = Impl::State::Idle;  // whatever follows, the buffers are free again after the sync
  MIXKV_PLANNER_CUDA(cudaStreamSynchronize(stream));
  const std::byte* h = m.results.get();
  const auto* status = reinterpret_cast<const int*>(h);
  if (status[0] != 0) {
    throw InvalidArgument(indexed("embeddings", static_cast<std::size_t>(status[1])) + " row " +
                          std::to_string(status[2]) + " (" +
                          (status[3] < 0 ? std::string("text") : "visual window " + std::to_string(status[3])) +
                          ") holds a NaN or infinite value, expected finite embeddings");
  }
  const std::int32_t layers = m.host.num_layers();
  std::vector<PrecisionPlan> plans;
  plans.reserve(m.windows_of.size());
  for (std::size_t r = 0; r < m.windows_of.size(); ++r) {
    const std::int32_t windows = m.windows_of[r];
    PrecisionPlan plan(layers, windows);
    for (std::int32_t i = 0; i < windows; ++i) {
      const std::byte* record = h + kRecordsOffset + (m.first_window_of[r] + i) * m.args.record_bytes;
      float score;
      std::memcpy(&score, record, sizeof score);
      plan.set_score(i, score);
      for (std::int32_t l = 0; l < layers; ++l) {
        plan.set(l, i, static_cast<Precision>(record[sizeof(float) + static_cast<std::size_t>(l)]));
      }
    }
    plans.push_back(std::move(plan));
  }
  return plans;
}

std::vector<PrecisionPlan> CudaWindowPlanner::plan(std::span<const TokenLayout> layouts,
                                                   std::span<const EmbeddingsView> embeddings, cudaStream_t stream) {
  prepare(layouts, embeddings, stream);
  try {
    launch(stream);
  } catch (...) {
    impl_->state = Impl::State::Idle;
    throw;
  }
  return finish(stream);
}

const float* CudaWindowPlanner::device_scores() const { return impl_->args.scores; }
const std::uint8_t* CudaWindowPlanner::device_precisions() const { return impl_->args.precisions; }
std::int64_t CudaWindowPlanner::num_windows() const { return impl_->args.num_windows; }

// ---------------------------------------------------------------------------
// Pairwise reference (cuBLAS)
// ---------------------------------------------------------------------------

namespace {

// Row `i` of `dst` = normalized row `rows[i]` (an address), in float; a zero
// row stays zero. No NaN check: this is the reference path.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    normalize_rows_kernel(const unsigned long long* rows, int count, int hidden, float* dst) {
  const int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= count) return;
  const auto* row = reinterpret_cast<const T*>(rows[i]);
  double ignored, squares;
  row_exact<T, false, false>(row, nullptr, hidden, lane, ignored, squares);
  const double inverse = squares > 0.0 ? 1.0 / sqrt(squares) : 0.0;
  for (int c = lane; c < hidden; c += kWarp) {
    dst[static_cast<long long>(i) * hidden + c] = static_cast<float>(to_float(row[c]) * inverse);
  }
}

// scores[i] = mean of the cosines of window i's S columns against all N text
// rows; cosines is column-major [window rows, N] (cuBLAS's C).
__global__ void __launch_bounds__(kBlockThreads)
    window_mean_kernel(const float* cosines, int window_rows, int text_rows, int window_size, float* scores) {
  __shared__ double partial[kBlockThreads];
  const int window = blockIdx.x;
  double sum = 0.0;
  const long long cells = static_cast<long long>(text_rows) * window_size;
  for (long long e = threadIdx.x; e < cells; e += blockDim.x) {
    const long long n = e / window_size;
    const long long k = e % window_size;
    sum += cosines[n * window_rows + static_cast<long long>(window) * window_size + k];
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kBlockThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) scores[window] = static_cast<float>(partial[0] / static_cast<double>(cells));
}

void launch_normalize(ElementType type, const unsigned long long* rows, int count, int hidden, float* dst,
                      cudaStream_t stream) {
  if (count == 0) return;
  const int blocks = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  switch (type) {
    case ElementType::F32:
      normalize_rows_kernel<float><<<blocks, kBlockThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
    case ElementType::F16:
      normalize_rows_kernel<__half><<<blocks, kBlockThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
    case ElementType::BF16:
      normalize_rows_kernel<__nv_bfloat16><<<blocks, kBlockThreads, 0, stream>>>(rows, count, hidden, dst);
      break;
  }
  MIXKV_PLANNER_LAUNCHED("normalize_rows_kernel");
}

// Stream-ordered scratch for one call.
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    MIXKV_PLANNER_CUDA(cudaMallocAsync(&ptr_, bytes, stream));
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() { cudaFreeAsync(ptr_, stream_); }
  std::byte* get() const { return static_cast<std::byte*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

void window_similarity_pairwise(std::span<const TokenLayout> layouts, std::span<const EmbeddingsView> embeddings,
                                std::int32_t window_size, float* scores, cublasHandle_t cublas, cudaStream_t stream) {
  validate_similarity_inputs(layouts, embeddings, window_size);
  if (layouts.empty()) return;
  if (scores == nullptr) throw InvalidArgument("scores is null, expected one device float per window");
  if (cublas == nullptr) throw InvalidArgument("cublas is null, expected a cuBLAS handle");
  const std::int32_t hidden = embeddings[0].hidden;

  // Row addresses per request: text rows, then each window's rows.
  std::vector<std::vector<unsigned long long>> rows(layouts.size());
  std::vector<std::int32_t> text_count(layouts.size()), window_count(layouts.size());
  std::size_t most_rows = 0, most_text = 0, most_window_rows = 0;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    const auto base = reinterpret_cast<std::uintptr_t>(embeddings[r].data);
    const std::size_t row_bytes = static_cast<std::size_t>(hidden) * element_bytes(embeddings[r].type);
    std::int32_t position = 0;
    for (const Segment& s : layouts[r].segments()) {
      if (s.kind == TokenKind::Text) {
        for (std::int32_t t = position; t < position + s.length; ++t) rows[r].push_back(base + t * row_bytes);
      }
      position += s.length;
    }
    text_count[r] = static_cast<std::int32_t>(rows[r].size());
    const std::vector<std::int32_t> starts = layouts[r].window_starts(window_size);
    window_count[r] = static_cast<std::int32_t>(starts.size());
    for (const std::int32_t start : starts) {
      for (std::int32_t k = 0; k < window_size; ++k) rows[r].push_back(base + (start + k) * row_bytes);
    }
    most_rows = std::max(most_rows, rows[r].size());
    most_text = std::max<std::size_t>(most_text, text_count[r]);
    most_window_rows = std::max(most_window_rows, rows[r].size() - text_count[r]);
  }

  Carver carve;
  const std::size_t o_rows = carve.add(most_rows * 8);
  const std::size_t o_normalized = carve.add(most_rows * static_cast<std::size_t>(hidden) * 4);
  const std::size_t o_cosines = carve.add(most_text * most_window_rows * 4);
  StreamScratch scratch(carve.total, stream);
  auto* d_rows = at_offset<unsigned long long>(scratch.get(), o_rows);
  auto* normalized = at_offset<float>(scratch.get(), o_normalized);
  auto* cosines = at_offset<float>(scratch.get(), o_cosines);

  check_cublas(cublasSetStream(cublas, stream), "cublasSetStream");
  std::size_t first_score = 0;
  for (std::size_t r = 0; r < layouts.size(); ++r) {
    const int n = text_count[r];
    const int m = window_count[r] * window_size;
    if (m > 0) {
      // Pageable source: the call returns once the rows are staged, so the
      // vector may go; the copy itself stays in stream order.
      MIXKV_PLANNER_CUDA(cudaMemcpyAsync(d_rows, rows[r].data(), rows[r].size() * 8, cudaMemcpyHostToDevice, stream));
      launch_normalize(embeddings[r].type, d_rows, static_cast<int>(rows[r].size()), hidden, normalized, stream);
      // Column-major view: the normalized rows are [hidden x rows]; C[m x n] =
      // window_rows^T (m x hidden) * text_rows (hidden x n). Pedantic FP32: no
      // TF32, whatever the handle's math mode, so this stays a reference.
      const float one = 1.0f, zero = 0.0f;
      const float* text = normalized;
      const float* window = normalized + static_cast<std::size_t>(n) * hidden;
      check_cublas(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, hidden, &one, window, CUDA_R_32F, hidden, text,
                                CUDA_R_32F, hidden, &zero, cosines, CUDA_R_32F, m, CUBLAS_COMPUTE_32F_PEDANTIC,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
      window_mean_kernel<<<window_count[r], kBlockThreads, 0, stream>>>(cosines, m, n, window_size,
                                                                        scores + first_score);
      MIXKV_PLANNER_LAUNCHED("window_mean_kernel");
    }
    first_score += static_cast<std::size_t>(window_count[r]);
  }
}

// ---------------------------------------------------------------------------
// Eq. 9 on the device
// ---------------------------------------------------------------------------

namespace {

struct SensitivityArgs {
  const unsigned long long* before;  // [layers] address of row 0
  const unsigned long long* after;   // [layers]
  double* sums;                      // [layers][tokens][3]: dot, |a|^2, |b|^2
  double* out;                       // [layers]
  int* status;                       // [flag, layer, token, side (0 before, 1 after)]
  long long tokens;
  int hidden;
  int token_mean;
};

__device__ void report_sensitivity(int* status, int layer, long long token, int side) {
  if (atomicCAS(status, 0, 1) == 0) {
    status[1] = layer;
    status[2] = static_cast<int>(token);
    status[3] = side;
  }
}

// Per (layer, token), a warp: dot, |a|^2, |b|^2 in double (these are
// calibration runs; exactness over speed).
template <typename T>
__global__ void __launch_bounds__(kBlockThreads) token_sums_kernel(SensitivityArgs a) {
  const long long t = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int layer = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  if (t >= a.tokens) return;
  const auto* x = reinterpret_cast<const T*>(a.before[layer]) + t * a.hidden;
  const auto* y = reinterpret_cast<const T*>(a.after[layer]) + t * a.hidden;
  double d = 0.0, nx = 0.0, ny = 0.0;
  for (int c = lane; c < a.hidden; c += kWarp) {
    const double xc = to_float(x[c]);
    const double yc = to_float(y[c]);
    d += xc * yc;
    nx += xc * xc;
    ny += yc * yc;
  }
  d = warp_sum(d);
  nx = warp_sum(nx);
  ny = warp_sum(ny);
  if (lane == 0) {
    if (!isfinite(nx)) report_sensitivity(a.status, layer, t, 0);
    if (!isfinite(ny)) report_sensitivity(a.status, layer, t, 1);
    double* s = a.sums + (static_cast<long long>(layer) * a.tokens + t) * 3;
    s[0] = d;
    s[1] = nx;
    s[2] = ny;
  }
}

// A block a layer; fixed-order tree sums, so results are reproducible.
__global__ void __launch_bounds__(kBlockThreads) layer_reduce_kernel(SensitivityArgs a) {
  __shared__ double partial[4][kBlockThreads];
  const int layer = blockIdx.x;
  double dot = 0.0, nx = 0.0, ny = 0.0, cosine = 0.0;
  for (long long t = threadIdx.x; t < a.tokens; t += blockDim.x) {
    const double* s = a.sums + (static_cast<long long>(layer) * a.tokens + t) * 3;
    dot += s[0];
    nx += s[1];
    ny += s[2];
    if (s[1] > 0.0 && s[2] > 0.0) cosine += s[0] / sqrt(s[1] * s[2]);
  }
  partial[0][threadIdx.x] = dot;
  partial[1][threadIdx.x] = nx;
  partial[2][threadIdx.x] = ny;
  partial[3][threadIdx.x] = cosine;
  __syncthreads();
  for (int stride = kBlockThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      for (int q = 0; q < 4; ++q) partial[q][threadIdx.x] += partial[q][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double s = 0.0;
    if (a.token_mean) {
      s = partial[3][0] / static_cast<double>(a.tokens);
    } else if (partial[1][0] > 0.0 && partial[2][0] > 0.0) {
      s = partial[0][0] / sqrt(partial[1][0] * partial[2][0]);
    }
    a.out[layer] = fmin(1.0, fmax(-1.0, s));
  }
}

}  // namespace

std::vector<double> layer_sensitivity(std::span<const EmbeddingsView> before, std::span<const EmbeddingsView> after,
                                      SensitivityReduction reduction, cudaStream_t stream) {
  validate_sensitivity_inputs(before, after, reduction);
  require_one_type(before, "before");
  for (std::size_t l = 0; l < after.size(); ++l) {
    if (after[l].type != before[0].type) {
      throw InvalidArgument(indexed("after", l) + ".type = " + std::to_string(static_cast<int>(after[l].type)) +
                            ", expected " + std::to_string(static_cast<int>(before[0].type)) +
                            " as before[0] (one element type on the GPU)");
    }
  }
  const std::size_t layers = before.size();
  if (layers > kMaxRequests) {
    throw InvalidArgument("before holds " + std::to_string(layers) + " layers, expected at most " +
                          std::to_string(kMaxRequests) + " on the GPU");
  }
  const long long tokens = before[0].num_tokens;

  Carver carve;
  const std::size_t o_before = carve.add(layers * 8);
  const std::size_t o_after = carve.add(layers * 8);
  const std::size_t o_out = carve.add(layers * 8);
  const std::size_t o_status = carve.add(16);
  const std::size_t o_sums = carve.add(layers * static_cast<std::size_t>(tokens) * 3 * 8);
  StreamScratch scratch(carve.total, stream);

  std::vector<unsigned long long> addresses(2 * layers);
  for (std::size_t l = 0; l < layers; ++l) {
    addresses[l] = reinterpret_cast<std::uintptr_t>(before[l].data);
    addresses[layers + l] = reinterpret_cast<std::uintptr_t>(after[l].data);
  }
  MIXKV_PLANNER_CUDA(
      cudaMemcpyAsync(scratch.get() + o_before, addresses.data(), layers * 8, cudaMemcpyHostToDevice, stream));
  MIXKV_PLANNER_CUDA(
      cudaMemcpyAsync(scratch.get() + o_after, addresses.data() + layers, layers * 8, cudaMemcpyHostToDevice, stream));
  MIXKV_PLANNER_CUDA(cudaMemsetAsync(scratch.get() + o_status, 0, 16, stream));

  SensitivityArgs a{};
  a.before = at_offset<const unsigned long long>(scratch.get(), o_before);
  a.after = at_offset<const unsigned long long>(scratch.get(), o_after);
  a.sums = at_offset<double>(scratch.get(), o_sums);
  a.out = at_offset<double>(scratch.get(), o_out);
  a.status = at_offset<int>(scratch.get(), o_status);
  a.tokens = tokens;
  a.hidden = before[0].hidden;
  a.token_mean = reduction == SensitivityReduction::TokenMean ? 1 : 0;

  const dim3 grid(static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock), static_cast<unsigned>(layers));
  switch (before[0].type) {
    case ElementType::F32:
      token_sums_kernel<float><<<grid, kBlockThreads, 0, stream>>>(a);
      break;
    case ElementType::F16:
      token_sums_kernel<__half><<<grid, kBlockThreads, 0, stream>>>(a);
      break;
    case ElementType::BF16:
      token_sums_kernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(a);
      break;
  }
  MIXKV_PLANNER_LAUNCHED("token_sums_kernel");
  layer_reduce_kernel<<<static_cast<unsigned>(layers), kBlockThreads, 0, stream>>>(a);
  MIXKV_PLANNER_LAUNCHED("layer_reduce_kernel");

  std::vector<double> sensitivities(layers);
  int status[4] = {0, 0, 0, 0};
  MIXKV_PLANNER_CUDA(cudaMemcpyAsync(sensitivities.data(), a.out, layers * 8, cudaMemcpyDeviceToHost, stream));
  MIXKV_PLANNER_CUDA(cudaMemcpyAsync(status, a.status, sizeof status, cudaMemcpyDeviceToHost, stream));
  MIXKV_PLANNER_CUDA(cudaStreamSynchronize(stream));
  if (status[0] != 0) {
    throw InvalidArgument(indexed(status[3] == 0 ? "before" : "after", static_cast<std::size_t>(status[1])) + " row " +
                          std::to_string(status[2]) +
                          " (hidden state) holds a NaN or infinite value, expected finite embeddings");
  }
  return sensitivities;
}

}  // namespace mixkv::gpu
