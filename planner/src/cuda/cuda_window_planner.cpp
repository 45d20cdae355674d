// CudaWindowPlanner: the host state machine (prepare, launch, finish) around
// the kernels of similarity_kernels.cu.
#include "mixkv/planner/cuda_window_planner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "host_helpers.h"
#include "mixkv/core/errors.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"
#include "similarity_kernels.h"

namespace mixkv::gpu {

using namespace planner_detail;

struct CudaWindowPlanner::Impl {
  enum class State { Idle, Prepared, Launched };

  WindowPlanner host;                         // validation, configuration and thresholds
  detail::DeviceBuffer<std::byte> constants;  // thresholds, min precisions
  detail::DeviceBuffer<std::byte> upload;     // the batch's work list
  detail::DeviceBuffer<std::byte> work;       // [scores | status | precisions | arrival counters] then scratch
  detail::PinnedBuffer<std::byte> staging;    // host side of `upload`
  // Written by the kernels (BatchArgs::host_results). Grown only in
  // prepare(), while no batch is in flight.
  detail::PinnedBuffer<std::byte> results{cudaHostAllocMapped};

  State state = State::Idle;
  BatchArgs args{};
  ElementType type = ElementType::F32;
  bool vectorized = false;
  bool dependent_launch = false;  // dependent_launch_usable() on the constructor's device
  int sms = 0;
  int l2_bytes = 0;
  RowLaunch rows;
  std::vector<std::int32_t> windows_of;       // per request
  std::vector<std::int64_t> first_window_of;  // per request

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
  m.constants.reserve(host.size());
  MIXKV_CUDA_CHECK(cudaMemcpy(m.constants.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  m.args.thresholds = at_offset<const LayerThresholds>(m.constants.get(), 0);
  m.args.min_precision = at_offset<const unsigned char>(m.constants.get(), o_min);
  m.args.window_size = m.host.config().window_size;
  m.args.num_layers = layers;
  int device = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&m.sms, cudaDevAttrMultiProcessorCount, device));
  MIXKV_CUDA_CHECK(cudaDeviceGetAttribute(&m.l2_bytes, cudaDevAttrL2CacheSize, device));
  m.dependent_launch = dependent_launch_usable();
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
  MIXKV_CUDA_CHECK(cudaMemcpyAsync(m.upload.get(), h, in.total, cudaMemcpyHostToDevice, stream));

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
  m.rows = plan_row_launch(m.type, m.vectorized, hidden, window_rows, m.sms, m.l2_bytes);
  a.prefetch_bytes = m.rows.prefetch_bytes;
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
  launch_similarity_kernels(m.type, m.vectorized, m.args, m.rows, dependent, vote, stream);
  // Without windows no kernel copies the error word to the host results.
  if (m.args.num_windows == 0) {
    MIXKV_CUDA_CHECK(cudaMemcpyAsync(m.results.get(), m.args.status, kRecordsOffset, cudaMemcpyDeviceToHost, stream));
  }
  m.state = Impl::State::Launched;
}

std::vector<PrecisionPlan> CudaWindowPlanner::finish(cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.state != Impl::State::Launched) {
    throw InvalidArgument("finish() without a launched batch, expected prepare() and launch() first");
  }
  m.state = Impl::State::Idle;  // whatever follows, the buffers are free again after the sync
  MIXKV_CUDA_CHECK(cudaStreamSynchronize(stream));
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

}  // namespace mixkv::gpu
