#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

namespace mixkv::gpu {

// The op and the argument of an id a kernel found out of range.
enum class StatusOp : std::uint8_t { Append = 1, CopyBlocks = 2, Demote = 3, SwapBlocks = 4 };
enum class StatusArg : std::uint8_t {
  Fp16Slot = 1,      // append: fp16_slots[row]
  CopySrc,           // copy_blocks: copies[row].src
  CopyDst,           // copy_blocks: copies[row].dst
  MoveSrc,           // demote: moves[row].src
  MoveDst,           // demote: moves[row].dst
  SwapPool,          // swap_blocks: copies[row].pool
  SwapDeviceBlock,   // swap_blocks: copies[row].device_block
  SwapHostSlot,      // swap_blocks: copies[row].host_slot
  MoveSrcNotFinite,  // demote: moves[row].src holds NaN or inf (value: the head)
};

// The first offence a kernel met: row `row` of the op's list held `value`,
// and the ids accepted were [0, limit) (for MoveSrcNotFinite: the source
// block of row `row` holds NaN or inf in head `value`).
struct StatusOffence {
  StatusOp op{};
  StatusArg arg{};
  std::int32_t row = 0;
  std::int32_t value = 0;
  std::uint32_t limit = 0;
};

// What the kernels write through (device addresses).
struct DeviceStatusView {
  unsigned long long* claim = nullptr;   // device memory: 0 until an offence claims it
  unsigned long long* record = nullptr;  // [2] mapped pinned host memory: the offence, code word last
};

// The device-side status of the ops that take ids in device arrays
// (append's slots, copy_blocks' copies, demote's moves, swap_blocks'
// copies). Such ids cannot be checked on the host without a copy back and a
// synchronization, so the kernel checks each row against the pool's
// num_blocks (one compare a row), skips a row out of range and records the
// first offence here; the context is never lost to a bad id. The host sees
// the record without a CUDA call once the stream has run the kernel:
// raise_if_set() throws it as IndexOutOfRange (what the Python bindings do
// at the start of the next op), check() synchronizes the stream first.
// One status serves one stream at a time.
class DeviceStatus {
 public:
  // Allocates its two words on the current device; DeviceError (OutOfMemory)
  // when CUDA cannot.
  DeviceStatus();
  ~DeviceStatus();
  DeviceStatus(DeviceStatus&&) noexcept;
  DeviceStatus& operator=(DeviceStatus&&) noexcept;
  DeviceStatus(const DeviceStatus&) = delete;
  DeviceStatus& operator=(const DeviceStatus&) = delete;

  DeviceStatusView view() const;

  // The offence recorded since the last reset, if the host sees one yet (no
  // CUDA call: complete once the offending kernel has finished).
  std::optional<StatusOffence> offence() const;
  // If an offence is recorded: clears the status (the device word in the
  // order of `stream`) and throws IndexOutOfRange with describe(offence)
  // (InvalidArgument for a source block that holds NaN or inf).
  // No synchronization.
  void raise_if_set(cudaStream_t stream);
  // Synchronizes `stream`, then raise_if_set(stream).
  void check(cudaStream_t stream);
  // Clears the status in the order of `stream`, dropping any offence.
  void reset(cudaStream_t stream);

  // E.g. "append: fp16_slots[3] = 992: expected a slot in [0, 992) or -1
  // (padding); the row was skipped".
  static std::string describe(const StatusOffence& offence);

  // The status of the current device that ops use when their args name
  // none: created on first use, kept for the life of the process.
  static DeviceStatus& for_current_device();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

#ifdef __CUDACC__
// Records an out-of-range id: the first offence since the last reset claims
// the device word and writes the record (value and limit first, then the
// code word, so a host that sees the code sees the whole record); later ones
// leave it as it is.
__device__ inline void report_out_of_range(const DeviceStatusView& status, StatusOp op, StatusArg arg, std::int32_t row,
                                           std::int32_t value, std::uint32_t limit) {
  const unsigned long long code = (1ull << 63) | (static_cast<unsigned long long>(op) << 56) |
                                  (static_cast<unsigned long long>(arg) << 48) |
                                  static_cast<unsigned long long>(static_cast<std::uint32_t>(row));
  if (atomicCAS(status.claim, 0ull, code) != 0ull) return;
  volatile unsigned long long* record = status.record;
  record[1] = (static_cast<unsigned long long>(static_cast<std::uint32_t>(value)) << 32) | limit;
  __threadfence_system();
  record[0] = code;
}

// True when `id` is not in [0, limit): one unsigned compare (a negative id
// wraps to at least 2^31).
__device__ __forceinline__ bool id_out_of_range(std::int32_t id, std::uint32_t limit) {
  return static_cast<std::uint32_t>(id) >= limit;
}
#endif

}  // namespace mixkv::gpu
