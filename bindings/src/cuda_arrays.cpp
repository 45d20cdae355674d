#include "cuda_arrays.h"

#include <string>

#include "mixkv/core/errors.h"

namespace mixkv::python {
namespace {

using std::string;

[[noreturn]] void fail(std::string_view where, const string& what) {
  throw InvalidArgument(string(where) + ": " + what);
}

void check_cuda(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess) {
    throw DeviceError(string(what) + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

std::intptr_t int_attr(py::handle obj, const char* name) { return obj.attr(name).cast<std::intptr_t>(); }

// The interface's producer stream: 1 and 2 are the legacy and per-thread
// default streams; None or absent means no synchronization is asked for.
void wait_for_producer(const py::dict& cai, cudaStream_t consumer) {
  if (!cai.contains("stream") || cai["stream"].is_none()) return;
  const auto value = cai["stream"].cast<std::intptr_t>();
  const cudaStream_t producer = value == 1   ? cudaStreamLegacy
                                : value == 2 ? cudaStreamPerThread
                                             : reinterpret_cast<cudaStream_t>(value);
  if (producer == consumer || (value == 1 && consumer == nullptr)) return;
  cudaEvent_t event = nullptr;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const cudaError_t recorded = cudaEventRecord(event, producer);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(consumer, event, 0) : recorded;
  cudaEventDestroy(event);
  check_cuda(waited, "waiting for the array's stream");
}

}  // namespace

int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

cudaStream_t stream_arg(py::handle stream) {
  if (stream.is_none()) {
    const py::dict modules = py::module_::import("sys").attr("modules");
    if (modules.contains("torch")) {
      return reinterpret_cast<cudaStream_t>(
          int_attr(modules["torch"].attr("cuda").attr("current_stream")(), "cuda_stream"));
    }
    if (modules.contains("cupy")) {
      return reinterpret_cast<cudaStream_t>(int_attr(modules["cupy"].attr("cuda").attr("get_current_stream")(), "ptr"));
    }
    return nullptr;
  }
  if (py::isinstance<py::int_>(stream)) return reinterpret_cast<cudaStream_t>(stream.cast<std::intptr_t>());
  if (py::hasattr(stream, "cuda_stream")) return reinterpret_cast<cudaStream_t>(int_attr(stream, "cuda_stream"));
  if (py::hasattr(stream, "ptr")) return reinterpret_cast<cudaStream_t>(int_attr(stream, "ptr"));
  throw InvalidArgument(
      "stream: expected None, an int (cudaStream_t), a torch.cuda.Stream or a cupy.cuda.Stream, got " +
      type_name(stream));
}

py::dict interface_of(py::handle obj, std::string_view where, const char* dtype) {
  try {
    return obj.attr("__cuda_array_interface__").cast<py::dict>();
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_AttributeError)) fail(where, e.what());  // e.g. torch: "requires grad"
    fail(where, string("expected a CUDA ") + dtype + " array (torch or CuPy, __cuda_array_interface__), got " +
                    type_name(obj) + (py::isinstance<py::array>(obj) ? " in host memory" : ""));
  }
}

std::vector<py::ssize_t> cuda_array_shape(py::handle obj, std::string_view where, const char* dtype) {
  // The dict must outlive the loop: an accessor into a temporary dict only
  // borrows it, and __cuda_array_interface__ builds a new dict on each read.
  const py::dict cai = interface_of(obj, where, dtype);
  std::vector<py::ssize_t> shape;
  for (const py::handle d : cai["shape"]) shape.push_back(d.cast<py::ssize_t>());
  return shape;
}

CudaArray check_cuda_array(py::handle obj, std::string_view where, std::span<const char* const> typestrs,
                           const char* dtype, std::span<const Dim> dims, std::size_t alignment, bool writable,
                           const CudaContext& ctx, string* typestr_found) {
  const py::dict cai = interface_of(obj, where, dtype);
  const string typestr = py::str(cai["typestr"]);
  bool known = false;
  for (const char* t : typestrs) known = known || typestr == t;
  if (!known) fail(where, string("expected dtype ") + dtype + ", got typestr '" + typestr + "'");
  if (cai.contains("mask") && !cai["mask"].is_none()) fail(where, "expected an array without a mask");

  const auto shape_tuple = cai["shape"].cast<py::tuple>();
  std::vector<py::ssize_t> shape;
  for (const py::handle d : shape_tuple) shape.push_back(d.cast<py::ssize_t>());
  bool match = shape.size() == dims.size();
  for (std::size_t i = 0; match && i < dims.size(); ++i) match = dims[i].size == kAny || dims[i].size == shape[i];
  if (!match) fail(where, "expected shape " + dims_text(dims) + ", got " + shape_text(shape));

  const py::ssize_t itemsize = typestr.size() >= 3 ? std::stoi(typestr.substr(2)) : 1;
  py::ssize_t count = 1;
  for (py::ssize_t d : shape) count *= d;
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    const auto strides = cai["strides"].cast<std::vector<py::ssize_t>>();
    py::ssize_t expected = itemsize;
    for (std::size_t i = shape.size(); i-- > 0;) {
      if (shape[i] != 1 && strides[i] != expected) {
        fail(where, "expected a C-contiguous array (.contiguous() makes one), got strides " + shape_text(strides));
      }
      expected *= shape[i];
    }
  }
  const auto data = cai["data"].cast<py::tuple>();
  void* ptr = reinterpret_cast<void*>(data[0].cast<std::uintptr_t>());
  if (writable && data[1].cast<bool>()) fail(where, "expected a writable array, got a read-only one");
  if (count > 0) {
    cudaPointerAttributes attributes{};
    check_cuda(cudaPointerGetAttributes(&attributes, ptr), string(where) + ": cudaPointerGetAttributes");
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
      fail(where, "expected device memory, got a pointer the CUDA runtime does not know as device memory");
    }
    if (attributes.device != ctx.device) {
      fail(where, "expected an array on CUDA device " + std::to_string(ctx.device) + ", got one on device " +
                      std::to_string(attributes.device));
    }
    if (reinterpret_cast<std::uintptr_t>(ptr) % alignment != 0) {
      fail(where, "expected an array starting on a " + std::to_string(alignment) +
                      "-byte boundary, got a view at an offset that is not (.clone() makes a fresh one)");
    }
  }
  wait_for_producer(cai, ctx.stream);
  if (typestr_found != nullptr) *typestr_found = typestr;
  return {ptr, std::move(shape)};
}

namespace {

// Device memory seen through __cuda_array_interface__ (uint8, 1-D).
struct DeviceBytes {
  std::uintptr_t data = 0;
  std::size_t bytes = 0;
  py::object owner;
};

}  // namespace

py::object device_bytes(void* data, std::size_t bytes, py::object owner) {
  return py::cast(DeviceBytes{reinterpret_cast<std::uintptr_t>(data), bytes, std::move(owner)});
}

void bind_device_memory(py::module_& cuda) {
  py::class_<DeviceBytes>(cuda, "DeviceBytes",
                          "Device memory as a 1-D uint8 CUDA array (torch.as_tensor(x, device='cuda') or "
                          "cupy.asarray(x) view it without a copy); keeps its owner alive.")
      .def_property_readonly("ptr", [](const DeviceBytes& b) { return b.data; })
      .def_property_readonly("nbytes", [](const DeviceBytes& b) { return b.bytes; })
      .def_property_readonly("__cuda_array_interface__", [](const DeviceBytes& b) {
        py::dict cai;
        cai["shape"] = py::make_tuple(b.bytes);
        cai["typestr"] = "|u1";
        cai["data"] = py::make_tuple(b.data, false);
        cai["strides"] = py::none();
        cai["version"] = 3;
        cai["stream"] = py::none();
        return cai;
      });
}

}  // namespace mixkv::python
