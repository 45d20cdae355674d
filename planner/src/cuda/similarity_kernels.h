#pragma once
// The GPU planner's similarity and plan kernels, as the host state machine
// (cuda_window_planner.cpp) sees them: the argument block and the launches
// (internal; docs/planner.md, "On the GPU", describes the kernels).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "mixkv/planner/window_planner.h"
#include "mixkv/planner/window_rules.h"

namespace mixkv::gpu::planner_detail {

// Mapped host results: the error word (4 ints), then the windows' records.
constexpr std::size_t kRecordsOffset = 4 * sizeof(int);

// The text mean lives in shared memory: 192 KiB at the limit, inside an
// sm_90 block's 227 KiB.
constexpr std::int32_t kMaxHidden = 49152;

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

// Launch geometry of the window-row kernel, fixed in prepare() so that
// launch() only enqueues.
struct RowLaunch {
  int grid = 0;
  std::size_t shared = 0;
  int prefetch_bytes = 0;  // BatchArgs::prefetch_bytes
};

// Every block of the row kernel resident at once on the current device
// (`sms` SMs, `l2_bytes` of L2), none without a row, for `window_rows` rows of
// `hidden` channels; `vectorized`: rows_aligned(). Throws DeviceError if a
// block fits no SM.
RowLaunch plan_row_launch(ElementType type, bool vectorized, std::int32_t hidden, std::size_t window_rows, int sms,
                          int l2_bytes);

// Whether the current device runs the kernels' sm_90 code, which
// programmatic dependent launch needs; otherwise kernels launch normally.
bool dependent_launch_usable();

// Enqueues text norms, text mean, window rows (with the plan) and, with
// `vote` and several requests, the majority vote, on `stream`; `dependent`:
// programmatic dependent launch for all but the first.
void launch_similarity_kernels(ElementType type, bool vectorized, const BatchArgs& args, const RowLaunch& rows,
                               bool dependent, bool vote, cudaStream_t stream);

}  // namespace mixkv::gpu::planner_detail
