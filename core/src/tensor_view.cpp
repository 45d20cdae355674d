#include "mixkv/core/tensor_view.h"

#include <string>

#include "mixkv/core/errors.h"

namespace mixkv {

namespace {

std::string device_name(DeviceKind kind, std::int32_t id) {
  switch (kind) {
    case DeviceKind::CPU: return "cpu";
    case DeviceKind::CUDA: return "cuda:" + std::to_string(id);
  }
  return "device(" + std::to_string(static_cast<int>(kind)) + ")";
}

std::string shape_text(std::initializer_list<std::int64_t> shape) {
  std::string s = "(";
  bool first = true;
  for (const std::int64_t d : shape) {
    if (!first) s += ", ";
    s += d < 0 ? std::string("any") : std::to_string(d);
    first = false;
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string shape_text(const TensorView& t) {
  if (t.ndim < 0 || t.ndim > 4) return "(ndim = " + std::to_string(t.ndim) + ")";
  std::string s = "(";
  for (std::int32_t i = 0; i < t.ndim; ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(t.shape[static_cast<std::size_t>(i)]);
  }
  return s + (t.ndim == 1 ? ",)" : ")");
}

}  // namespace

void require_tensor(const char* fn, const char* name, const TensorView& t, DType dtype, DeviceKind device,
                    std::int32_t device_id, std::initializer_list<std::int64_t> shape) {
  bool ok = t.dtype == dtype && t.device == device && (device != DeviceKind::CUDA || t.device_id == device_id) &&
            t.ndim == static_cast<std::int32_t>(shape.size()) && t.ndim >= 0 && t.ndim <= 4;
  if (ok) {
    std::size_t i = 0;
    for (const std::int64_t d : shape) {
      const std::int64_t got = t.shape[i++];
      ok = ok && got >= 0 && (d < 0 || got == d);
    }
    // Extents past ndim must be 1 so that numel() and bytes() hold.
    for (; i < t.shape.size(); ++i) ok = ok && t.shape[i] == 1;
  }
  if (!ok) {
    throw InvalidArgument(std::string(fn) + ": " + name + ": expected dtype " + to_string(dtype) + " on " +
                          device_name(device, device_id) + " with shape " + shape_text(shape) + ", got " +
                          to_string(t.dtype) + " on " + device_name(t.device, t.device_id) + " with shape " +
                          shape_text(t));
  }
  if (t.data == nullptr && t.numel() > 0) {
    throw InvalidArgument(std::string(fn) + ": " + name + ": data is null: expected " + std::to_string(t.numel()) +
                          " elements");
  }
}

}  // namespace mixkv
