// mixkv.KVCache: a KVCacheManager that owns host memory for its arena.
#include "host_kv_cache.h"

#include <string>

#include <pybind11/numpy.h>

#include "bindings.h"
#include "mixkv/core/errors.h"

namespace mixkv::python {

namespace {

// calloc: the pages are only touched when KV bytes are written, and every
// block format is 16-byte aligned inside a slab, which malloc guarantees.
std::byte* host_bytes(std::size_t bytes, const char* name) {
  auto* p = static_cast<std::byte*>(std::calloc(bytes == 0 ? 1 : bytes, 1));
  if (p == nullptr) {
    throw OutOfMemory(std::string(name) + " = " + std::to_string(bytes) +
                      ": the host cannot allocate it, expected less");
  }
  return p;
}

}  // namespace

HostKVCache::HostKVCache(CacheConfig config)
    : KVCacheManager(config),
      arena_(host_bytes(config.arena_bytes, "arena_bytes")),
      swap_(host_bytes(swap_bytes(), "swap_bytes()")) {}

PoolViews HostKVCache::pools() const {
  PoolViews views;
  for (Precision p : kAllPrecisions) views[pool_index(p)] = pool_view(p, arena());
  return views;
}

PoolViews HostKVCache::swap_pools() const {
  PoolViews views;
  for (Precision p : kAllPrecisions) views[pool_index(p)] = swap_view(p, swap());
  return views;
}

void bind_host_kv_cache(py::module_& m) {
  py::class_<HostKVCache, KVCacheManager>(
      m, "KVCache", init_only(),
      "A KVCacheManager with host memory for its arena: the cache of the CPU backend, which mixkv.ops fill and "
      "read with NumPy arrays.")
      .def(py::init<CacheConfig>(), py::arg("config"))
      .def_property_readonly(
          "arena",
          [](py::object self) {
            const auto& cache = self.cast<const HostKVCache&>();
            const auto bytes = static_cast<py::ssize_t>(cache.config().arena_bytes);
            return py::array_t<std::uint8_t>({bytes}, {py::ssize_t{1}}, reinterpret_cast<std::uint8_t*>(cache.arena()),
                                             self);
          },
          "The whole arena as a uint8 array (a view, not a copy).")
      .def_property_readonly(
          "swap",
          [](py::object self) {
            const auto& cache = self.cast<const HostKVCache&>();
            const auto bytes = static_cast<py::ssize_t>(cache.swap_bytes());
            return py::array_t<std::uint8_t>({bytes}, {py::ssize_t{1}}, reinterpret_cast<std::uint8_t*>(cache.swap()),
                                             self);
          },
          "The host swap pool (config.swap_blocks slots) as a uint8 array view.")
      .def(
          "block",
          [](py::object self, Precision p, std::int32_t block_id) {
            const auto& cache = self.cast<const HostKVCache&>();
            const PoolStats stats = cache.pool_stats(p);
            const std::int64_t limit = static_cast<std::int64_t>(cache.total_slabs()) * stats.blocks_per_slab;
            if (block_id < 0 || block_id >= limit) {
              throw IndexOutOfRange("block_id = " + std::to_string(block_id) + ", expected 0 <= block_id < " +
                                    std::to_string(limit) + " (slabs * blocks_per_slab of " +
                                    std::string(to_string(p)) + ")");
            }
            const PoolView view = cache.pool_view(p, cache.arena());
            return py::array_t<std::uint8_t>({static_cast<py::ssize_t>(stats.block_bytes)}, {py::ssize_t{1}},
                                             reinterpret_cast<std::uint8_t*>(view.block(block_id)), self);
          },
          py::arg("precision"), py::arg("block_id"),
          "The bytes of one block of a pool as a uint8 array (a view, laid out as BlockFormat says).");
}

}  // namespace mixkv::python
