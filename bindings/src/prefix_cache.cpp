// PrefixCacheConfig and PrefixCacheStats: the knobs and the counters of
// prefix caching (CacheConfig.prefix_cache, KVCacheManager.prefix_stats).
#include <string>

#include <pybind11/stl.h>

#include "bindings.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv::python {

namespace {

std::string counts_text(const BlockCounts& c) {
  return "[" + std::to_string(c[0]) + ", " + std::to_string(c[1]) + ", " + std::to_string(c[2]) + "]";
}

}  // namespace

void bind_prefix_cache(py::module_& m) {
  py::class_<PrefixCacheConfig>(
      m, "PrefixCacheConfig", init_only(),
      "Prefix caching: full prompt blocks outlive their request in an index keyed by their content "
      "(Request.token_keys), and a later prompt with the same prefix shares them instead of recomputing.")
      .def(py::init([](bool enabled, bool share_higher) {
             return PrefixCacheConfig{enabled, share_higher};
           }),
           py::arg("enabled") = false, py::arg("share_higher") = true)
      .def_readwrite("enabled", &PrefixCacheConfig::enabled)
      .def_readwrite("share_higher", &PrefixCacheConfig::share_higher,
                     "A window cached at a higher precision than the plan wants is shared at that precision "
                     "(more bytes, better accuracy); False: the match ends there and the window is recomputed. "
                     "A lower cached precision is never shared.")
      .def("__repr__", [](const PrefixCacheConfig& c) {
        return std::string("PrefixCacheConfig(enabled=") + (c.enabled ? "True" : "False") +
               ", share_higher=" + (c.share_higher ? "True" : "False") + ")";
      });

  py::class_<PrefixCacheStats>(m, "PrefixCacheStats", init_only(),
                               "The prefix index's blocks and counters; block counts per pool [FP16, INT4, INT2].")
      .def_readonly("cached", &PrefixCacheStats::cached, "blocks the index holds")
      .def_readonly("evictable", &PrefixCacheStats::evictable,
                    "of them, held by no sequence: they count as free and are evicted LRU first")
      .def_readonly("published", &PrefixCacheStats::published, "blocks indexed, in total")
      .def_readonly("hits", &PrefixCacheStats::hits, "admissions that shared a block")
      .def_readonly("hit_rows", &PrefixCacheStats::hit_rows, "prompt rows those admissions found cached")
      .def_readonly("shared", &PrefixCacheStats::shared, "blocks they shared")
      .def_readonly("evicted", &PrefixCacheStats::evicted, "blocks evicted")
      .def("__repr__", [](const PrefixCacheStats& s) {
        return "PrefixCacheStats(cached=" + counts_text(s.cached) + ", evictable=" + counts_text(s.evictable) +
               ", published=" + std::to_string(s.published) + ", hits=" + std::to_string(s.hits) +
               ", hit_rows=" + std::to_string(s.hit_rows) + ", shared=" + counts_text(s.shared) +
               ", evicted=" + counts_text(s.evicted) + ")";
      });
}

}  // namespace mixkv::python
