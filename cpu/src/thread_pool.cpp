#include "thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mixkv::cpu::detail {
namespace {

// Threads beyond this are never started: the work units are (sequence, KV
// head) pairs and key chunks, and no host decodes faster past this many.
constexpr int kMaxWorkers = 256;

class Pool {
 public:
  void run(int workers, const std::function<void()>& task) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) {  // another caller's decode: do this one alone
      task();
      return;
    }
    const int helpers = std::min(workers, kMaxWorkers) - 1;
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
    }
    {
      std::lock_guard lock(mutex_);
      task_ = &task;
      helpers_ = helpers;
      pending_ = helpers;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    std::exception_ptr own_error;
    try {
      task();
    } catch (...) {
      own_error = std::current_exception();
    }
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
    if (own_error) std::rethrow_exception(own_error);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop(int index) {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= helpers_) continue;
      const std::function<void()>* task = task_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*task)();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;      // guards everything below
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void()>* task_ = nullptr;
  std::uint64_t generation_ = 0;
  int helpers_ = 0;
  int pending_ = 0;
  std::exception_ptr error_;
};

// The pool of this process, never freed: its threads wait on it until the
// process exits (joining them in a static destructor would race with other
// static destructors and hang in a forked child). A child forked while the
// pool exists has none of its threads (and maybe a locked mutex), so it
// starts a pool of its own and abandons the inherited one.
Pool& pool() {
  static std::mutex mutex;
  static Pool* current = nullptr;
  static pid_t owner = 0;
  std::lock_guard lock(mutex);
  const pid_t pid = getpid();
  if (current == nullptr || owner != pid) {
    current = new Pool;
    owner = pid;
  }
  return *current;
}

}  // namespace

void run_parallel(int workers, const std::function<void()>& task) {
  if (workers <= 1) {
    task();
    return;
  }
  pool().run(workers, task);
}

int default_num_threads() {
  if (const char* env = std::getenv("MIXKV_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0) return static_cast<int>(std::min<long>(n, kMaxWorkers));
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace mixkv::cpu::detail
