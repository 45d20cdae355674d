// PrefixIdentity, PrefixHigher, PrefixCacheConfig and PrefixCacheStats: the
// knobs and the counters of prefix caching (CacheConfig.prefix_cache,
// KVCacheManager.prefix_stats).
#include <string>

#include <pybind11/native_enum.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv::python {

namespace {

std::string counts_text(const BlockCounts& c) {
  return "[" + std::to_string(c[0]) + ", " + std::to_string(c[1]) + ", " + std::to_string(c[2]) + "]";
}

const char* identity_name(PrefixIdentity identity) {
  return identity == PrefixIdentity::Content ? "PrefixIdentity.Content" : "PrefixIdentity.Precision";
}

const char* higher_name(PrefixHigher higher) {
  return higher == PrefixHigher::Keep ? "PrefixHigher.Keep" : "PrefixHigher.Demote";
}

}  // namespace

void bind_prefix_cache(py::module_& m) {
  py::native_enum<PrefixIdentity>(m, "PrefixIdentity", "enum.IntEnum",
                                  "What names a cached block besides its rows' keys (PrefixCacheConfig.identity).")
      .value("Precision", PrefixIdentity::Precision,
             "the precision of every window up to its end, its own included: a block is shared only behind "
             "the same plan (rows prefilled reading quantized windows, PrefillMode.Compact, differ by plan)")
      .value("Content", PrefixIdentity::Content,
             "the tokens alone: every row is computed reading FP16 keys (needs PrefillMode.Exact and "
             "fp16_windows_first); a window keeps copies at one or more precisions and a plan takes the copy it "
             "wants, or reads the FP16 copy and demotes to its own")
      .finalize();
  py::native_enum<PrefixHigher>(m, "PrefixHigher", "enum.IntEnum",
                                "Content identity: a window a plan wants below the FP16 copy the cache holds "
                                "(and holds at no lower copy the plan wants) (PrefixCacheConfig.higher).")
      .value("Demote", PrefixHigher::Demote,
             "shared FP16 while the prompt is prefilled, then demoted to the plan's precision in a block of the "
             "sequence's own: each request decodes at its own plan")
      .value("Keep", PrefixHigher::Keep, "kept at FP16 for decoding too: more bytes, no demotion")
      .finalize();

  py::class_<PrefixCacheConfig>(
      m, "PrefixCacheConfig", init_only(),
      "Prefix caching: full prompt blocks outlive their request in an index keyed by their content "
      "(Request.token_keys), and a later prompt with the same prefix shares them instead of recomputing.")
      .def(py::init([](bool enabled, bool share_higher, PrefixIdentity identity, PrefixHigher higher) {
             PrefixCacheConfig c;
             c.enabled = enabled;
             c.share_higher = share_higher;
             c.identity = identity;
             c.higher = higher;
             return c;
           }),
           py::arg("enabled") = false, py::arg("share_higher") = true, py::arg("identity") = PrefixIdentity::Precision,
           py::arg("higher") = PrefixHigher::Demote)
      .def_readwrite("enabled", &PrefixCacheConfig::enabled)
      .def_readwrite("share_higher", &PrefixCacheConfig::share_higher,
                     "A window cached at a higher precision than the plan wants is shared at that precision "
                     "(more bytes, better accuracy); False: the match ends there and the window is recomputed. "
                     "A lower cached precision is never shared. Under Content identity this covers copies "
                     "above the plan's precision other than an FP16 one (see higher).")
      .def_readwrite("identity", &PrefixCacheConfig::identity,
                     "What names a cached block besides its keys: PrefixIdentity.Precision (the plan up to it) or "
                     "PrefixIdentity.Content (the tokens alone; needs PrefillMode.Exact and fp16_windows_first).")
      .def_readwrite("higher", &PrefixCacheConfig::higher,
                     "Content identity: what happens to a window shared from an FP16 copy that its plan wants "
                     "lower: PrefixHigher.Demote (demoted after the prefill) or PrefixHigher.Keep (decoded FP16).")
      .def("__repr__", [](const PrefixCacheConfig& c) {
        return std::string("PrefixCacheConfig(enabled=") + (c.enabled ? "True" : "False") +
               ", share_higher=" + (c.share_higher ? "True" : "False") + ", identity=" + identity_name(c.identity) +
               ", higher=" + higher_name(c.higher) + ")";
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
