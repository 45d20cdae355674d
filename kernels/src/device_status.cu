#include "mixkv/kernels/device_status.h"

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "mixkv/core/errors.h"
#include "mixkv/kernels/detail/cuda_check.h"
#include "mixkv/kernels/detail/device_buffer.h"

namespace mixkv::gpu {

struct DeviceStatus::Impl {
  detail::DeviceBuffer<unsigned long long> claim;
  // Mapped so that the kernel that claims the status writes the record
  // straight into host memory: reading it needs no copy and no sync.
  detail::PinnedBuffer<unsigned long long> record{cudaHostAllocMapped | cudaHostAllocPortable};

  volatile unsigned long long* host_record() const { return record.get(); }
};

DeviceStatus::DeviceStatus() : impl_(std::make_unique<Impl>()) {
  impl_->claim.allocate(1);
  impl_->record.reserve(2);
  MIXKV_CUDA_CHECK(cudaMemset(impl_->claim.get(), 0, sizeof(unsigned long long)));
  impl_->host_record()[0] = 0;
  impl_->host_record()[1] = 0;
}

DeviceStatus::~DeviceStatus() = default;
DeviceStatus::DeviceStatus(DeviceStatus&&) noexcept = default;
DeviceStatus& DeviceStatus::operator=(DeviceStatus&&) noexcept = default;

DeviceStatusView DeviceStatus::view() const {
  detail::require(impl_ != nullptr, "DeviceStatus: moved from: expected a live DeviceStatus");
  return {impl_->claim.get(), impl_->record.device()};
}

std::optional<StatusOffence> DeviceStatus::offence() const {
  if (impl_ == nullptr) return std::nullopt;
  const unsigned long long code = impl_->host_record()[0];
  if (code == 0) return std::nullopt;
  // The kernel wrote the second word before the code word.
  std::atomic_thread_fence(std::memory_order_acquire);
  const unsigned long long rest = impl_->host_record()[1];
  StatusOffence o;
  o.op = static_cast<StatusOp>((code >> 56) & 0x7f);
  o.arg = static_cast<StatusArg>((code >> 48) & 0xff);
  o.row = static_cast<std::int32_t>(static_cast<std::uint32_t>(code & 0xffffffffu));
  o.value = static_cast<std::int32_t>(static_cast<std::uint32_t>(rest >> 32));
  o.limit = static_cast<std::uint32_t>(rest & 0xffffffffu);
  return o;
}

void DeviceStatus::reset(cudaStream_t stream) {
  detail::require(impl_ != nullptr, "DeviceStatus: moved from: expected a live DeviceStatus");
  MIXKV_CUDA_CHECK(cudaMemsetAsync(impl_->claim.get(), 0, sizeof(unsigned long long), stream));
  impl_->host_record()[0] = 0;
  impl_->host_record()[1] = 0;
}

void DeviceStatus::raise_if_set(cudaStream_t stream) {
  const std::optional<StatusOffence> o = offence();
  if (!o) return;
  reset(stream);
  if (o->arg == StatusArg::MoveSrcNotFinite) throw InvalidArgument(describe(*o));
  throw IndexOutOfRange(describe(*o));
}

void DeviceStatus::check(cudaStream_t stream) {
  MIXKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  raise_if_set(stream);
}

std::string DeviceStatus::describe(const StatusOffence& o) {
  const std::string row = std::to_string(o.row);
  const std::string value = std::to_string(o.value);
  const std::string range = "[0, " + std::to_string(o.limit) + ")";
  switch (o.arg) {
    case StatusArg::Fp16Slot:
      return "append: fp16_slots[" + row + "] = " + value + ": expected a slot in " + range +
             " of the FP16 pool, or -1 (padding); the row was skipped";
    case StatusArg::CopySrc:
    case StatusArg::CopyDst:
      return "copy_blocks: copies[" + row + "]." + (o.arg == StatusArg::CopySrc ? "src" : "dst") + " = " + value +
             ": expected a block id in " + range + " of the pool; the copy was skipped";
    case StatusArg::MoveSrc:
      return "demote: moves[" + row + "].src = " + value + ": expected a block id in " + range +
             " of src_pool; the move was skipped";
    case StatusArg::MoveDst:
      return "demote: moves[" + row + "].dst = " + value + ": expected a block id in " + range +
             " of dst_pool; the move was skipped";
    case StatusArg::SwapPool:
      return "swap_blocks: copies[" + row + "].pool = " + value +
             ": expected FP16 (0), INT4 (1) or INT2 (2); the copy was skipped";
    case StatusArg::SwapDeviceBlock:
      return "swap_blocks: copies[" + row + "].device_block = " + value + ": expected a block id in " + range +
             " of its device pool; the copy was skipped";
    case StatusArg::MoveSrcNotFinite:
      return "demote: moves[" + row + "].src holds NaN or inf (head " + value +
             "): a corrupt block cannot be requantized; that head of the move was skipped";
    case StatusArg::SwapHostSlot:
      return "swap_blocks: copies[" + row + "].host_slot = " + value + ": expected a slot in " + range +
             " of its swap pool; the copy was skipped";
  }
  return "device status: op " + std::to_string(static_cast<int>(o.op)) + ", argument " +
         std::to_string(static_cast<int>(o.arg)) + ", row " + row + " = " + value + ": expected " + range;
}

DeviceStatus& DeviceStatus::for_current_device() {
  // One per device, never destroyed: its memory goes with the process (a
  // static destructor could run after the CUDA runtime is torn down).
  static std::mutex mutex;
  static std::vector<DeviceStatus*> statuses;
  int device = 0;
  MIXKV_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (statuses.size() <= static_cast<std::size_t>(device)) statuses.resize(static_cast<std::size_t>(device) + 1);
  if (statuses[device] == nullptr) statuses[device] = new DeviceStatus();
  return *statuses[device];
}

}  // namespace mixkv::gpu
