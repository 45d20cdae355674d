#pragma once
#include <cstddef>

#include <cuda_runtime_api.h>

namespace mixkv::gpu {

// The device's read bandwidth as our own kernel sees it: a read-and-reduce
// over `bytes` of device memory (16-byte loads, several in flight), median
// of `repetitions` CUDA-event timings after a warm-up. Bytes per second.
double measure_read_bandwidth(std::size_t bytes, int repetitions, cudaStream_t stream);

// One launch of that read-and-reduce over `bytes` at `data` (16-byte
// aligned, bytes a positive multiple of 16; `sink`: one device unsigned it
// may write). Benchmarks time it beside a kernel that moves as many bytes:
// a transfer of tens of MB does not reach a 4 GiB stream's rate (ramp and
// tail), and this says what a plain read of that size does reach.
void launch_streaming_read(const void* data, std::size_t bytes, unsigned* sink, cudaStream_t stream);

// How L2Flusher evicts: `read` leaves L2 full of clean lines (FlashInfer's
// benchmarks and anchors.md flush this way); `write` (a memset) leaves it
// full of dirty lines, whose write-back the next kernel pays for.
enum class FlushMode { read, write };

// Evicts the L2 cache by touching a buffer four times its size (benchmarks
// call this before each timed launch so that batch-1 timings measure HBM).
class L2Flusher {
 public:
  explicit L2Flusher(FlushMode mode = FlushMode::read);
  ~L2Flusher();
  L2Flusher(const L2Flusher&) = delete;
  L2Flusher& operator=(const L2Flusher&) = delete;
  void flush(cudaStream_t stream);

 private:
  void release();
  void* buffer_ = nullptr;
  unsigned* sink_ = nullptr;
  std::size_t bytes_ = 0;
  FlushMode mode_;
};

}  // namespace mixkv::gpu
