#pragma once
// Timing helpers shared by the CUDA benchmarks (decode_bench, swap_bench).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace mixkv::bench {

// A benchmark has nothing to recover: a failed CUDA call ends it.
inline void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median of `reps` CUDA-event timings (us) of launch() on `stream`, after
// three untimed warm-up runs; before_each() runs untimed before every run
// (an L2 flush, for one).
template <typename Launch, typename BeforeEach>
double median_event_us(int reps, cudaStream_t stream, Launch&& launch, BeforeEach&& before_each) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  std::vector<float> ms;
  for (int i = -3; i < reps; ++i) {
    before_each();
    ok(cudaEventRecord(a, stream), "record");
    launch();
    ok(cudaEventRecord(b, stream), "record");
    ok(cudaEventSynchronize(b), "sync");
    float t = 0;
    ok(cudaEventElapsedTime(&t, a, b), "elapsed");
    if (i >= 0) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1000.0;
}

template <typename Launch>
double median_event_us(int reps, cudaStream_t stream, Launch&& launch) {
  return median_event_us(reps, stream, launch, [] {});
}

}  // namespace mixkv::bench
