// Precision, CacheShape, CacheConfig, BlockFormat, PoolStats: the value types
// that describe a cache.
#include <string>

#include <pybind11/native_enum.h>
#include <pybind11/operators.h>

#include <pybind11/stl.h>

#include "bindings.h"
#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/block_format.h"
#include "mixkv/core/cache_shape.h"
#include "mixkv/core/dtype.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/precision.h"

namespace mixkv::python {

namespace {

// A BlockFormat parameter accessor for Python: quantized formats only, the
// index (a channel or a token) checked against its count in the format.
auto param_offset(std::size_t (BlockFormat::*offset)(int) const, const char* fn, const char* index,
                  std::int32_t BlockFormat::*count) {
  return [=](const BlockFormat& f, std::int32_t i) {
    if (!is_quantized(f.precision)) {
      throw InvalidArgument(std::string(fn) + ": precision " + std::string(to_string(f.precision)) +
                            ": expected INT4 or INT2 (FP16 blocks have no params)");
    }
    if (i < 0 || i >= f.*count) {
      throw InvalidArgument(std::string(fn) + ": " + index + " = " + std::to_string(i) + ": expected in [0, " +
                            std::to_string(f.*count) + ")");
    }
    return (f.*offset)(i);
  };
}

// A cache's dtype as Python gives it: a mixkv.DType, a name ("bfloat16"),
// or anything whose str() is one (torch.bfloat16, numpy.dtype("float16")).
DType dtype_argument(py::handle obj) {
  if (!py::isinstance<py::str>(obj)) {
    try {
      return obj.cast<DType>();
    } catch (const py::cast_error&) {
    }
  }
  if (py::hasattr(obj, "name") && !py::isinstance<py::str>(obj) && py::hasattr(obj, "itemsize")) {
    return parse_dtype(std::string(py::str(obj.attr("name"))), "shape.dtype");  // a NumPy dtype
  }
  return parse_dtype(std::string(py::str(obj)), "shape.dtype");
}

}  // namespace

void bind_cache_shape(py::module_& m) {
  py::native_enum<DType>(m, "DType", "enum.IntEnum",
                         "Element type of arrays; a cache's 16-bit type (CacheShape.dtype) is F16 or BF16.")
      .value("F16", DType::F16, "IEEE binary16 (numpy.float16, torch.float16)")
      .value("BF16", DType::BF16, "bfloat16 (torch.bfloat16): the top half of a float32")
      .value("F32", DType::F32, "float32")
      .value("I32", DType::I32, "int32")
      .finalize();
  m.def(
      "dtype_name", [](DType t) { return to_string(t); }, py::arg("dtype"),
      "'float16', 'bfloat16', 'float32' or 'int32': the name NumPy and torch give the type.");
  py::native_enum<Precision>(m, "Precision", "enum.IntEnum",
                             "Storage precision of a block; the value is the pool index (FP16 0, INT4 1, INT2 2).")
      .value("FP16", Precision::FP16, "IEEE half, 16 bits")
      .value("INT4", Precision::INT4, "4-bit codes, K per channel and V per token (scale, min) in FP16")
      .value("INT2", Precision::INT2, "2-bit codes, same grouping as INT4")
      .finalize();
  m.def("bits_of", &bits_of, py::arg("precision"), "Bits of one stored value: 16, 4 or 2.");
  m.def("is_quantized", &is_quantized, py::arg("precision"), "True for INT4 and INT2.");

  py::class_<CacheShape>(m, "CacheShape", init_only(),
                         "Geometry every pool of a cache shares. block_size is also the WindowQuant window.")
      .def(py::init([](std::int32_t num_layers, std::int32_t num_kv_heads, std::int32_t head_dim,
                       std::int32_t block_size, py::handle dtype) {
             return CacheShape{num_layers, num_kv_heads, head_dim, block_size, dtype_argument(dtype)};
           }),
           py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size") = 32,
           py::arg("dtype") = DType::F16,
           "dtype: the cache's 16-bit type, DType.F16 or DType.BF16 (or a name: 'bfloat16', torch.bfloat16); "
           "K, V, queries and outputs are of it.")
      .def_readwrite("num_layers", &CacheShape::num_layers)
      .def_readwrite("num_kv_heads", &CacheShape::num_kv_heads)
      .def_readwrite("head_dim", &CacheShape::head_dim)
      .def_readwrite("block_size", &CacheShape::block_size)
      .def_property(
          "dtype", [](const CacheShape& s) { return s.dtype; },
          [](CacheShape& s, py::handle dtype) { s.dtype = dtype_argument(dtype); },
          "The cache's 16-bit type (DType.F16 or DType.BF16): of the FP16 pool's values, the INT4/INT2 pools' "
          "(scale, min), and K, V, q and out.")
      .def(
          "validate", [](const CacheShape& s) { validate(s); },
          "Raises ValueError naming the field unless num_layers >= 1, num_kv_heads >= 1, head_dim a multiple of 16 "
          "in [16, 512], block_size a multiple of 16 in [16, 256] and dtype F16 or BF16.")
      .def(py::self == py::self)
      .def("__repr__", [](const CacheShape& s) { return to_string(s); });

  py::class_<CacheConfig>(m, "CacheConfig", init_only(),
                          "A cache: its shape, the bytes of its one arena, the slab size.")
      .def(py::init([](const CacheShape& shape, std::size_t arena_bytes, std::size_t slab_bytes,
                       const BlockCounts& swap_blocks, bool fp16_windows_first, const PrefixCacheConfig& prefix_cache) {
             return CacheConfig{shape, arena_bytes, slab_bytes, swap_blocks, fp16_windows_first, prefix_cache};
           }),
           py::arg("shape"), py::arg("arena_bytes"), py::arg("slab_bytes") = CacheConfig{}.slab_bytes,
           py::arg("swap_blocks") = BlockCounts{}, py::arg("fp16_windows_first") = false,
           py::arg("prefix_cache") = PrefixCacheConfig{})
      .def_readwrite("shape", &CacheConfig::shape)
      .def_readwrite("arena_bytes", &CacheConfig::arena_bytes, "Total KV memory, all pools together.")
      .def_readwrite("slab_bytes", &CacheConfig::slab_bytes, "Unit in which memory moves between pools.")
      .def_readwrite("swap_blocks", &CacheConfig::swap_blocks,
                     "Host swap slots per pool [FP16, INT4, INT2]; all 0: no swapping.")
      .def_readwrite("fp16_windows_first", &CacheConfig::fp16_windows_first,
                     "Pack each FP16 visual window in a block of its own, first, so that every one can be demoted.")
      .def_readwrite("prefix_cache", &CacheConfig::prefix_cache, "mixkv.PrefixCacheConfig (off by default).")
      .def("__repr__", [](const CacheConfig& c) {
        return "CacheConfig(shape=" + std::string(py::repr(py::cast(c.shape))) +
               ", arena_bytes=" + std::to_string(c.arena_bytes) + ", slab_bytes=" + std::to_string(c.slab_bytes) +
               ", swap_blocks=" + std::string(py::repr(py::cast(c.swap_blocks))) +
               ", fp16_windows_first=" + (c.fp16_windows_first ? "True" : "False") +
               ", prefix_cache=" + std::string(py::repr(py::cast(c.prefix_cache))) + ")";
      });

  py::class_<BlockFormat>(m, "BlockFormat", init_only(), "Byte layout of one block of a precision (block_format.h).")
      .def(py::init([](Precision precision, std::int32_t num_kv_heads, std::int32_t head_dim, std::int32_t block_size,
                       py::handle dtype) {
             return BlockFormat{precision, num_kv_heads, head_dim, block_size, dtype_argument(dtype)};
           }),
           py::arg("precision"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
           py::arg("dtype") = DType::F16)
      .def_readonly("precision", &BlockFormat::precision)
      .def_readonly("num_kv_heads", &BlockFormat::num_kv_heads)
      .def_readonly("head_dim", &BlockFormat::head_dim)
      .def_readonly("block_size", &BlockFormat::block_size)
      .def_readonly("dtype", &BlockFormat::dtype, "The cache's 16-bit type of the FP16 values and (scale, min).")
      .def_property_readonly("bits", &BlockFormat::bits)
      .def_property_readonly("k_channel_bytes", &BlockFormat::k_channel_bytes)
      .def_property_readonly("v_token_bytes", &BlockFormat::v_token_bytes)
      .def_property_readonly("k_offset", &BlockFormat::k_offset)
      .def_property_readonly("v_offset", &BlockFormat::v_offset)
      .def_property_readonly("k_params_offset", &BlockFormat::k_params_offset)
      .def_property_readonly("v_params_offset", &BlockFormat::v_params_offset)
      .def("k_scale_offset",
           param_offset(&BlockFormat::k_scale_offset, "k_scale_offset", "channel", &BlockFormat::head_dim),
           py::arg("channel"),
           "Byte offset in a head of channel's K scale (a half); K params go by channel pair: mins, then scales.")
      .def("k_min_offset", param_offset(&BlockFormat::k_min_offset, "k_min_offset", "channel", &BlockFormat::head_dim),
           py::arg("channel"), "Byte offset in a head of channel's K minimum (a half).")
      .def("v_scale_offset",
           param_offset(&BlockFormat::v_scale_offset, "v_scale_offset", "token", &BlockFormat::block_size),
           py::arg("token"), "Byte offset in a head of token's V scale (a half); V params are (scale, min) per token.")
      .def("v_min_offset", param_offset(&BlockFormat::v_min_offset, "v_min_offset", "token", &BlockFormat::block_size),
           py::arg("token"), "Byte offset in a head of token's V minimum (a half).")
      .def_property_readonly(
          "k_runs_are_bytes", &BlockFormat::k_runs_are_bytes,
          "Whether a channel's K codes are 8 one-byte runs, stored run-major (INT4 x 16, INT2 x 32).")
      .def(
          "k_code_byte",
          [](const BlockFormat& f, std::int32_t channel, std::int32_t i) {
            constexpr const char* fn = "k_code_byte";
            if (!is_quantized(f.precision)) {
              throw InvalidArgument(std::string(fn) + ": precision " + std::string(to_string(f.precision)) +
                                    ": expected INT4 or INT2 (FP16 blocks hold no codes)");
            }
            if (channel < 0 || channel >= f.head_dim) {
              throw InvalidArgument(std::string(fn) + ": channel = " + std::to_string(channel) + ": expected in [0, " +
                                    std::to_string(f.head_dim) + ")");
            }
            const auto bytes = static_cast<std::int64_t>(f.k_channel_bytes());
            if (i < 0 || i >= bytes) {
              throw InvalidArgument(std::string(fn) + ": i = " + std::to_string(i) +
                                    ": expected in [0, k_channel_bytes = " + std::to_string(bytes) + ")");
            }
            return f.k_code_byte(channel, i);
          },
          py::arg("channel"), py::arg("i"),
          "Byte offset in a head of byte i of channel's K codes (tokens i * 8 / bits ..., low bits first).")
      .def_property_readonly("head_bytes", &BlockFormat::head_bytes)
      .def_property_readonly("block_bytes", &BlockFormat::block_bytes)
      .def("__repr__", [](const BlockFormat& f) {
        return "BlockFormat(precision=" + std::string(to_string(f.precision)) +
               ", num_kv_heads=" + std::to_string(f.num_kv_heads) + ", head_dim=" + std::to_string(f.head_dim) +
               ", block_size=" + std::to_string(f.block_size) + ", block_bytes=" + std::to_string(f.block_bytes()) +
               ")";
      });
  m.def("bytes_per_token_per_head", &bytes_per_token_per_head, py::arg("precision"), py::arg("head_dim"),
        py::arg("block_size"), "Bytes one token of one KV head takes in a precision, metadata included.");

  py::class_<PoolStats>(m, "PoolStats", init_only(), "Usage of one pool.")
      .def_readonly("block_bytes", &PoolStats::block_bytes)
      .def_readonly("blocks_per_slab", &PoolStats::blocks_per_slab)
      .def_readonly("slabs", &PoolStats::slabs, "Slabs this pool holds now.")
      .def_readonly("used_blocks", &PoolStats::used_blocks, "Blocks owned by at least one page table.")
      .def_readonly("free_blocks", &PoolStats::free_blocks, "Free blocks inside this pool's slabs.")
      .def("__repr__", [](const PoolStats& s) {
        return "PoolStats(block_bytes=" + std::to_string(s.block_bytes) +
               ", blocks_per_slab=" + std::to_string(s.blocks_per_slab) + ", slabs=" + std::to_string(s.slabs) +
               ", used_blocks=" + std::to_string(s.used_blocks) + ", free_blocks=" + std::to_string(s.free_blocks) +
               ")";
      });
}

}  // namespace mixkv::python
