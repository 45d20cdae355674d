#pragma once
#include <functional>

namespace mixkv::cpu::detail {

// Runs `task` on up to `workers` threads at once, the calling thread being
// one of them, and returns when every call has returned. Tasks are expected
// to pull work from a shared counter until it runs out, so any number of
// calls (even one) completes the work: while another caller holds the pool,
// or `workers` is 1, the caller runs `task` alone. The pool's threads are
// created on first use and kept (a decode step calls this once per layer,
// and starting threads each time would cost more than small layers take).
// The first exception a task throws is rethrown here after all calls end.
void run_parallel(int workers, const std::function<void()>& task);

// MIXKV_NUM_THREADS when set to a positive integer, else
// std::thread::hardware_concurrency() (at least 1). Read at each call, so
// a process can change it between calls.
int default_num_threads();

}  // namespace mixkv::cpu::detail
