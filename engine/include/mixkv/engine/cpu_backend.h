#pragma once
#include <memory>

#include "mixkv/core/pool_view.h"
#include "mixkv/engine/backend.h"

namespace mixkv {

// The CPU backend with its host memory in reach: for callers that read KV
// bytes themselves (test harnesses comparing blocks before and after a swap,
// snapshots of a sequence), which the Backend interface does not expose
// because on the CUDA backend the same bytes live on the device.
// make_cpu_backend() returns one of these as a Backend.
class CpuBackend : public Backend {
 public:
  // Throws what make_cpu_backend() throws.
  static std::unique_ptr<CpuBackend> create(const BackendConfig& config);

  // The arena's pools (block ids as the manager hands them out) and the
  // host swap buffer's (SwapCopy::host_slot). The views stay valid as long
  // as the backend; the bytes change only inside apply(), store() and
  // attend(). They are for reading: a write bypasses every check.
  virtual PoolViews arena_pools() const = 0;
  virtual PoolViews swap_pools() const = 0;
};

}  // namespace mixkv
