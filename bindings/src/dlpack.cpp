// Arrays into TensorViews through DLPack, __cuda_array_interface__ or the
// buffer protocol (dlpack.h). The DLPack header is Debian's libdlpack-dev
// (the 0.6 ABI: the legacy "dltensor" capsule holding a DLManagedTensor).
#include "dlpack.h"

#include <dlpack/dlpack.h>

#include <span>
#include <utility>
#include <vector>

#include "mixkv/core/errors.h"

#ifdef MIXKV_PYTHON_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mixkv::python {

using std::string;

namespace {

[[noreturn]] void fail(std::string_view fn, std::string_view arg, const string& what) {
  throw InvalidArgument(string(fn) + ": " + string(arg) + ": " + what);
}

string expected_text(const ArrayExpect& e) {
  string types;
  std::size_t i = 0;
  for (DType t : e.dtypes) {
    if (i > 0) types += i + 1 == e.dtypes.size() ? " or " : ", ";
    types += dtype_name(t);
    ++i;
  }
  return "expected a C-contiguous " + types + " array on " + device_name(e.device, e.device_id);
}

}  // namespace

string shape_text(std::span<const std::int64_t> values) {
  string s = "(";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(values[i]);
  }
  return s + (values.size() == 1 ? ",)" : ")");
}

namespace {

// The element type of a DLPack dtype, or its name in `name` when mixkv has
// no such type.
bool dl_dtype(const DLDataType& t, DType& out, string& name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 16) return out = DType::F16, true;
    if (t.code == kDLBfloat && t.bits == 16) return out = DType::BF16, true;
    if (t.code == kDLFloat && t.bits == 32) return out = DType::F32, true;
    if (t.code == kDLInt && t.bits == 32) return out = DType::I32, true;
  }
  const char* kind = t.code == kDLFloat     ? "float"
                     : t.code == kDLInt     ? "int"
                     : t.code == kDLUInt    ? "uint"
                     : t.code == kDLBfloat  ? "bfloat"
                     : t.code == kDLComplex ? "complex"
                                            : nullptr;
  name = kind != nullptr ? kind + std::to_string(t.bits) : "DLPack type code " + std::to_string(t.code);
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return false;
}

// A buffer-protocol format string ("e", "<f", "=i") as an element type.
bool buffer_dtype(const char* format, Py_ssize_t itemsize, DType& out, string& name) {
  string f = format != nullptr ? format : "B";
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f.erase(0, 1);
  if (f == "e" && itemsize == 2) return out = DType::F16, true;
  if (f == "f" && itemsize == 4) return out = DType::F32, true;
  if ((f == "i" || f == "l") && itemsize == 4) return out = DType::I32, true;
  name = "buffer format '" + string(format != nullptr ? format : "B") + "'";
  return false;
}

bool c_contiguous(std::span<const std::int64_t> shape, const std::int64_t* strides_in_elements) {
  if (strides_in_elements == nullptr) return true;
  // An empty array has no element to misplace (NumPy exports strides 0 for it).
  for (std::int64_t extent : shape) {
    if (extent == 0) return true;
  }
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides_in_elements[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// Every check on a view made from any protocol; `strides` in elements (null:
// compact).
void check_view(std::string_view fn, std::string_view arg, const ArrayExpect& e, const TensorView& v,
                std::span<const std::int64_t> shape, const std::int64_t* strides) {
  bool dtype_ok = false;
  for (DType t : e.dtypes) dtype_ok = dtype_ok || t == v.dtype;
  const bool device_ok = v.device == e.device && (v.device == DeviceKind::CPU || v.device_id == e.device_id);
  if (!dtype_ok || !device_ok) {
    string got = dtype_name(v.dtype);
    if (!device_ok) got += " on " + device_name(v.device, v.device_id);
    fail(fn, arg, expected_text(e) + ", got " + got);
  }
  if (!c_contiguous(shape, strides)) {
    fail(fn, arg,
         expected_text(e) + ", got a non-contiguous array with strides " + shape_text({strides, shape.size()}) +
             " elements (.contiguous() or numpy.ascontiguousarray makes one)");
  }
  if (reinterpret_cast<std::uintptr_t>(v.data) % dtype_bytes(v.dtype) != 0) {
    fail(fn, arg, expected_text(e) + ", got data at an address that is not a multiple of its item size");
  }
}

void set_shape(std::string_view fn, std::string_view arg, const ArrayExpect& e, TensorView& v,
               std::span<const std::int64_t> shape) {
  if (shape.size() > v.shape.size()) {
    fail(fn, arg, expected_text(e) + " of at most 4 dimensions, got shape " + shape_text(shape));
  }
  v.ndim = static_cast<std::int32_t>(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) fail(fn, arg, "got a negative extent in shape " + shape_text(shape));
    v.shape[i] = shape[i];
  }
}

bool is_error(const py::error_already_set& e, PyObject* type) { return e.matches(type); }

#ifdef MIXKV_PYTHON_CUDA
cudaStream_t stream_value(std::intptr_t s) {
  // The array interface's 1 and 2 are the legacy and per-thread default streams.
  if (s == 1) return cudaStreamLegacy;
  if (s == 2) return cudaStreamPerThread;
  return reinterpret_cast<cudaStream_t>(s);
}

// Makes `consumer` wait for the producer stream an interface names (version
// 3), without blocking the host.
void wait_for_producer(std::string_view fn, std::string_view arg, const py::dict& cai, std::intptr_t consumer) {
  if (!cai.contains("stream") || cai["stream"].is_none()) return;
  const auto producer = cai["stream"].cast<std::intptr_t>();
  if (producer == consumer) return;
  cudaEvent_t event = nullptr;
  cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status == cudaSuccess) status = cudaEventRecord(event, stream_value(producer));
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream_value(consumer), event, 0);
  if (event != nullptr) cudaEventDestroy(event);
  if (status != cudaSuccess) {
    throw DeviceError(string(fn) + ": " + string(arg) +
                      ": waiting for the producer stream: " + cudaGetErrorString(status));
  }
}
#endif

}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F32: return "float32";
    case DType::I32: return "int32";
  }
  return "?";
}

string device_name(DeviceKind device, std::int32_t device_id) {
  return device == DeviceKind::CPU ? "cpu" : "cuda:" + std::to_string(device_id);
}

string object_type_name(py::handle obj) {
  const py::handle type = py::type::handle_of(obj);
  const string module = py::str(type.attr("__module__"));
  const string name = py::str(type.attr("__qualname__"));
  return module == "builtins" ? name : module + "." + name;
}

BorrowedArray::BorrowedArray(BorrowedArray&& other) noexcept
    : view_(other.view_),
      protocol_(other.protocol_),
      managed_(std::exchange(other.managed_, nullptr)),
      buffer_(other.buffer_),
      has_buffer_(std::exchange(other.has_buffer_, false)),
      owner_(std::move(other.owner_)) {}

BorrowedArray& BorrowedArray::operator=(BorrowedArray&& other) noexcept {
  if (this != &other) {
    release();
    view_ = other.view_;
    protocol_ = other.protocol_;
    managed_ = std::exchange(other.managed_, nullptr);
    buffer_ = other.buffer_;
    has_buffer_ = std::exchange(other.has_buffer_, false);
    owner_ = std::move(other.owner_);
  }
  return *this;
}

BorrowedArray::~BorrowedArray() { release(); }

void BorrowedArray::release() noexcept {
  // The consumer of a renamed ("used_dltensor") capsule owns the tensor and
  // calls its deleter exactly once.
  if (managed_ != nullptr) {
    if (managed_->deleter != nullptr) managed_->deleter(managed_);
    managed_ = nullptr;
  }
  if (has_buffer_) {
    PyBuffer_Release(&buffer_);
    has_buffer_ = false;
  }
  owner_ = py::object();
}

// Takes the DLManagedTensor of an unused "dltensor" capsule into `out`
// (renaming the capsule, so that from here on out's destructor runs the
// deleter) and checks it against `expect`.
void take_capsule(py::handle capsule, std::string_view fn, std::string_view arg, const ArrayExpect& expect,
                  BorrowedArray& out) {
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  if (PyCapsule_SetName(capsule.ptr(), "used_dltensor") != 0) throw py::error_already_set();
  out.managed_ = managed;
  out.protocol_ = "dlpack";
  const DLTensor& t = managed->dl_tensor;
  TensorView& v = out.view_;
  string type_name;
  if (!dl_dtype(t.dtype, v.dtype, type_name)) fail(fn, arg, expected_text(expect) + ", got " + type_name);
  if (t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost) {
    v.device = DeviceKind::CPU;
    v.device_id = 0;
  } else if (t.device.device_type == kDLCUDA) {
    v.device = DeviceKind::CUDA;
    v.device_id = t.device.device_id;
  } else {
    fail(fn, arg,
         expected_text(expect) + ", got an array on DLPack device type " +
             std::to_string(static_cast<int>(t.device.device_type)));
  }
  if (t.ndim < 0) fail(fn, arg, "got a DLPack tensor of " + std::to_string(t.ndim) + " dimensions");
  const std::span<const std::int64_t> shape(t.shape, static_cast<std::size_t>(t.ndim));
  set_shape(fn, arg, expect, v, shape);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  check_view(fn, arg, expect, v, shape, t.strides);
}

BorrowedArray borrow_array(py::handle obj, std::string_view fn, std::string_view arg, const ArrayExpect& expect) {
  BorrowedArray out;
  string refused;  // why a protocol the object offers refused to export it

  // 0. A DLPack capsule itself (torch.utils.dlpack.to_dlpack's): its
  // producer has ordered its writes for the consumer's stream already.
  if (PyCapsule_CheckExact(obj.ptr())) {
    if (!PyCapsule_IsValid(obj.ptr(), "dltensor")) {
      fail(fn, arg,
           expected_text(expect) + ", got a used or foreign capsule (a \"dltensor\" DLPack capsule is taken once)");
    }
    take_capsule(obj, fn, arg, expect, out);
    return out;
  }

  // 1. DLPack.
  if (py::hasattr(obj, "__dlpack__")) {
    int device_type = kDLCPU;
    if (py::hasattr(obj, "__dlpack_device__")) {
      const auto dev = obj.attr("__dlpack_device__")().cast<py::tuple>();
      device_type = dev[0].cast<int>();
    }
    py::object capsule;
    try {
      if (device_type == kDLCUDA) {
        // 0 is ambiguous in the protocol; 1 names the legacy default stream.
        capsule = obj.attr("__dlpack__")(py::arg("stream") = expect.stream == 0 ? 1 : expect.stream);
      } else {
        capsule = obj.attr("__dlpack__")();
      }
    } catch (py::error_already_set& e) {
      // BufferError: this array cannot go through DLPack (NumPy: read-only);
      // the other protocols may still take it. Anything else is the
      // producer's word on why not (torch: "requires grad").
      const string why = string(py::str(e.type().attr("__name__"))) + ": " + string(py::str(e.value()));
      if (!is_error(e, PyExc_BufferError)) fail(fn, arg, "__dlpack__() of " + object_type_name(obj) + " raised " + why);
      refused = why;
    }
    if (capsule) {
      if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
        fail(fn, arg, "__dlpack__() of " + object_type_name(obj) + " returned no unused \"dltensor\" capsule");
      }
      take_capsule(capsule, fn, arg, expect, out);
      return out;
    }
  }

  // 2. __cuda_array_interface__.
  if (py::hasattr(obj, "__cuda_array_interface__")) {
#ifdef MIXKV_PYTHON_CUDA
    const py::dict cai = obj.attr("__cuda_array_interface__").cast<py::dict>();
    TensorView& v = out.view_;
    const string typestr = py::str(cai["typestr"]);
    const string code = typestr.size() >= 2 ? typestr.substr(1) : typestr;
    if (typestr.size() < 3 || typestr[0] == '>') {
      fail(fn, arg, expected_text(expect) + ", got typestr '" + typestr + "'");
    } else if (code == "f2") {
      v.dtype = DType::F16;
    } else if (code == "f4") {
      v.dtype = DType::F32;
    } else if (code == "i4") {
      v.dtype = DType::I32;
    } else {
      fail(fn, arg, expected_text(expect) + ", got typestr '" + typestr + "'");
    }
    if (cai.contains("mask") && !cai["mask"].is_none()) fail(fn, arg, "expected an array without a mask");
    std::vector<std::int64_t> shape;
    for (const py::handle d : cai["shape"]) shape.push_back(d.cast<std::int64_t>());
    set_shape(fn, arg, expect, v, shape);
    std::vector<std::int64_t> strides;
    if (cai.contains("strides") && !cai["strides"].is_none()) {
      const auto itemsize = static_cast<std::int64_t>(dtype_bytes(v.dtype));
      for (const py::handle s : cai["strides"]) {
        const auto bytes = s.cast<std::int64_t>();
        strides.push_back(bytes % itemsize == 0 ? bytes / itemsize : -1);
      }
    }
    const auto data = cai["data"].cast<py::tuple>();
    v.data = reinterpret_cast<void*>(data[0].cast<std::uintptr_t>());
    if (expect.writable && data[1].cast<bool>()) {
      fail(fn, arg, expected_text(expect) + ", got a read-only array");
    }
    v.device = DeviceKind::CUDA;
    v.device_id = expect.device_id;
    if (v.numel() > 0) {
      cudaPointerAttributes attributes{};
      if (cudaPointerGetAttributes(&attributes, v.data) != cudaSuccess ||
          (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)) {
        cudaGetLastError();
        fail(fn, arg, expected_text(expect) + ", got a pointer the CUDA runtime does not know as device memory");
      }
      v.device_id = attributes.device;
    }
    check_view(fn, arg, expect, v, shape, strides.empty() ? nullptr : strides.data());
    wait_for_producer(fn, arg, cai, expect.stream);
    out.owner_ = py::reinterpret_borrow<py::object>(obj);
    out.protocol_ = "cuda_array_interface";
    return out;
#else
    fail(fn, arg,
         expected_text(expect) + ", got " + object_type_name(obj) +
             " in device memory through __cuda_array_interface__ (mixkv was built without CUDA)");
#endif
  }

  // 3. The buffer protocol.
  if (PyObject_CheckBuffer(obj.ptr()) != 0) {
    Py_buffer buffer{};
    const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (expect.writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &buffer, flags) != 0) {
      PyErr_Clear();
      Py_buffer probe{};
      if (expect.writable && PyObject_GetBuffer(obj.ptr(), &probe, PyBUF_STRIDES | PyBUF_FORMAT) == 0) {
        PyBuffer_Release(&probe);
        fail(fn, arg, expected_text(expect) + ", got a read-only array");
      }
      PyErr_Clear();
      fail(fn, arg, expected_text(expect) + ", got " + object_type_name(obj) + " whose buffer cannot be read");
    }
    out.buffer_ = buffer;
    out.has_buffer_ = true;
    out.protocol_ = "buffer";
    TensorView& v = out.view_;
    string type_name;
    if (!buffer_dtype(buffer.format, buffer.itemsize, v.dtype, type_name)) {
      fail(fn, arg, expected_text(expect) + ", got " + type_name);
    }
    std::vector<std::int64_t> shape(buffer.shape, buffer.shape + buffer.ndim);
    set_shape(fn, arg, expect, v, shape);
    std::vector<std::int64_t> strides;
    for (int i = 0; i < buffer.ndim; ++i) {
      strides.push_back(buffer.strides[i] % buffer.itemsize == 0 ? buffer.strides[i] / buffer.itemsize : -1);
    }
    v.data = buffer.buf;
    v.device = DeviceKind::CPU;
    v.device_id = 0;
    check_view(fn, arg, expect, v, shape, strides.empty() ? nullptr : strides.data());
    return out;
  }

  fail(fn, arg,
       expected_text(expect) + ", got " + object_type_name(obj) +
           (refused.empty() ? " (no __dlpack__, __cuda_array_interface__ or buffer)" : " (" + refused + ")"));
}

}  // namespace mixkv::python
