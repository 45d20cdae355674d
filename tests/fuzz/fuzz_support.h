#pragma once
// Shared by the libFuzzer targets (tests/fuzz/*_fuzz.cpp, docs/reliability.md):
// the typed-error rule, a finding that aborts (libFuzzer then saves the
// input as a crash file), the counters printed at exit, and a shadow of the
// KV contents that proves no sequence's tokens are lost or overwritten.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/errors.h"
#include "mixkv/core/hash.h"

namespace mixkv::fuzz {

// Totals over the whole fuzzing process, printed at exit for the figures of
// docs/reliability.md.
struct Counters {
  std::uint64_t inputs = 0;
  std::uint64_t calls = 0;         // public calls made
  std::uint64_t typed_errors = 0;  // calls that threw a typed error (state checked unchanged)
  std::uint64_t verified = 0;      // content checks of a whole sequence against the shadow
  // Per public call: (calls, calls that returned).
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> by_call;
};
inline Counters counters;

inline void print_counters() {
  if (counters.inputs == 0) return;  // the -jobs parent process: its children report
  std::fprintf(stderr, "mixkv fuzz totals: %llu inputs, %llu calls, %llu typed errors, %llu content checks\n",
               static_cast<unsigned long long>(counters.inputs), static_cast<unsigned long long>(counters.calls),
               static_cast<unsigned long long>(counters.typed_errors),
               static_cast<unsigned long long>(counters.verified));
  for (const auto& [call, n] : counters.by_call) {
    std::fprintf(stderr, "  %-28s %12llu calls %12llu returned\n", call.c_str(),
                 static_cast<unsigned long long>(n.first), static_cast<unsigned long long>(n.second));
  }
}

// MIXKV_FUZZ_TRACE=1 in the environment: every call and its outcome on
// stderr, to turn a saved input into a hand-written reproducer.
inline const bool tracing = std::getenv("MIXKV_FUZZ_TRACE") != nullptr;

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "mixkv fuzz finding: %s\n", what.c_str());
  std::abort();
}

// How a public call ended: returned, or threw one of the typed errors.
enum class Outcome : std::uint8_t { Ok, InvalidArgument, OutOfMemory, UnknownId, IndexOutOfRange };

// After every call: the invariants hold, and a call that failed (or only
// reads) left the canonical state text exactly as it was.
template <class Checked>
void check_consistency(const Checked& checked, const std::string& before, bool unchanged) {
  try {
    checked.check_invariants();
  } catch (const std::exception& e) {
    finding(std::string("check_invariants: ") + e.what());
  }
  if (unchanged && checked.describe_state() != before) {
    finding("a failed or const call changed the state:\nbefore:\n" + before + "after:\n" + checked.describe_state());
  }
}

// Runs one public call. A typed error of errors.h is an allowed outcome;
// InvariantViolation (the code caught itself in an inconsistent state), any
// other exception or a non-exception throw is a finding, and so is a typed
// error without a message.
template <class F>
Outcome attempt(const char* what, F&& call) {
  ++counters.calls;
  auto& tally = counters.by_call[what];
  ++tally.first;
  Outcome outcome = Outcome::Ok;
  const char* kind = nullptr;
  std::string message;
  try {
    call();
    ++tally.second;
    if (tracing) std::fprintf(stderr, "  %s -> ok\n", what);
    return Outcome::Ok;
  } catch (const InvalidArgument& e) {
    outcome = Outcome::InvalidArgument;
    message = e.what();
  } catch (const OutOfMemory& e) {
    outcome = Outcome::OutOfMemory;
    message = e.what();
  } catch (const UnknownId& e) {
    outcome = Outcome::UnknownId;
    message = e.what();
  } catch (const IndexOutOfRange& e) {
    outcome = Outcome::IndexOutOfRange;
    message = e.what();
  } catch (const InvariantViolation& e) {
    kind = "InvariantViolation";
    message = e.what();
  } catch (const std::exception& e) {
    kind = "an untyped exception";
    message = e.what();
  } catch (...) {
    kind = "a non-exception";
  }
  if (tracing) std::fprintf(stderr, "  %s -> %s\n", what, message.c_str());
  if (kind != nullptr) finding(std::string(what) + " threw " + kind + ": " + message);
  if (message.empty()) finding(std::string(what) + " threw a typed error without a message");
  ++counters.typed_errors;
  return outcome;
}

using Tag = std::uint64_t;  // 0: never written, or released

inline Tag mix(Tag x) { return mix64(x) | 1; }  // never 0
// The tag a token's K/V row has in `layer`, and the tag of a quantized
// window whose first token is `first` (one tag per block: a window is
// stored whole).
inline Tag layer_tag(Tag token, std::int32_t layer) { return mix(token ^ (Tag{0x9E37} * (layer + 1))); }
inline Tag window_tag(Tag first_token_in_layer) { return mix(first_token_in_layer ^ 0xC0DEULL); }

// Prefix caching: content keys from one of a few prompts, sometimes cut
// short, and the tags they give: a keyed row's tag is a function of the rows
// up to it (prompts with a common prefix have the same tags there), a row
// past the keys gets fresh().
inline std::vector<TokenKey> prompt_keys(FuzzedDataProvider& in, const TokenLayout& layout, std::int32_t bs) {
  std::vector<TokenKey> keys;
  const TokenKey prompt = in.ConsumeIntegralInRange<TokenKey>(1, 3);
  const auto n = std::min<std::int64_t>(layout.num_tokens(), in.ConsumeIntegralInRange<std::int64_t>(0, 4 * bs));
  for (std::int64_t i = 0; i < n; ++i) keys.push_back(prompt * 1000 + static_cast<TokenKey>(i));
  return keys;
}
template <class Fresh>
std::vector<Tag> prompt_tags(const TokenLayout& layout, const std::vector<TokenKey>& keys, Fresh&& fresh) {
  std::vector<Tag> tags;
  Tag h = 0;
  for (const Segment& seg : layout.segments()) {
    for (std::int32_t i = 0; i < seg.length; ++i) {
      if (tags.size() >= keys.size()) {
        tags.push_back(fresh());
        continue;
      }
      h = mix(h ^ mix(keys[tags.size()] * 2 + (seg.kind == TokenKind::Visual ? 1 : 0)));
      tags.push_back(h);
    }
  }
  return tags;
}

// What the KV memory holds, one tag per FP16 token slot and per quantized
// block, for the device pools and the host swap pool. Writes follow what the
// manager hands out (mappings, slots, copy lists, demote ops), the way a
// backend applies them; verify() compares a sequence's blocks with the
// tokens it must hold.
class Shadow {
 public:
  explicit Shadow(const KVCacheManager& cache) : cache_(cache), bs_(cache.config().shape.block_size) {
    for (const Precision p : kAllPrecisions) {
      const auto blocks =
          static_cast<std::size_t>(cache.pool_stats(p).blocks_per_slab) * static_cast<std::size_t>(cache.total_slabs());
      const auto host = static_cast<std::size_t>(cache.config().swap_blocks[pool_index(p)]);
      const std::size_t per_block = p == Precision::FP16 ? static_cast<std::size_t>(bs_) : 1;
      device_[pool_index(p)].assign(blocks * per_block, 0);
      host_[pool_index(p)].assign(host * per_block, 0);
    }
  }

  Tag& fp16_slot(std::int32_t slot) { return at(device_[0], slot, "FP16 slot"); }
  Tag& quantized(Precision p, std::int32_t block) { return at(device_[pool_index(p)], block, "quantized block"); }

  void copy_fp16_block(std::int32_t src, std::int32_t dst) {
    for (std::int32_t t = 0; t < bs_; ++t) fp16_slot(dst * bs_ + t) = fp16_slot(src * bs_ + t);
  }

  // swap_out copies (device -> host) or swap_in copies (host -> device).
  void swap(const std::vector<SwapCopy>& copies, bool to_host) {
    for (const SwapCopy& c : copies) {
      const std::size_t n = c.pool == Precision::FP16 ? static_cast<std::size_t>(bs_) : 1;
      std::vector<Tag>& dev = device_[pool_index(c.pool)];
      std::vector<Tag>& host = host_[pool_index(c.pool)];
      for (std::size_t i = 0; i < n; ++i) {
        Tag& d = at(dev, static_cast<std::int64_t>(static_cast<std::size_t>(c.device_block) * n + i), "swap device");
        Tag& h = at(host, static_cast<std::int64_t>(static_cast<std::size_t>(c.host_slot) * n + i), "swap host slot");
        if (to_host) {
          h = d;
        } else {
          d = h;
          h = 0;  // the slot is free again: whoever reads it next reads garbage
        }
      }
    }
  }

  // The requantize kernel: the window's first token names the window.
  void demote(const std::vector<DemoteOp>& ops) {
    for (const DemoteOp& op : ops) {
      const Tag src = op.src_precision == Precision::FP16 ? window_tag(fp16_slot(op.src_block * bs_))
                                                          : quantized(op.src_precision, op.src_block);
      quantized(op.dst_precision, op.dst_block) = src;
    }
  }

  // The blocks of `id` (resident) hold exactly `tokens` (tags per position,
  // before layer_tag): the FP16 tokens as a multiset (decode ignores their
  // order), each quantized pool's windows in window order.
  void verify(SequenceId id, const std::vector<Tag>& tokens) {
    ++counters.verified;
    const TokenLayout& layout = cache_.layout(id);
    const PrecisionPlan& plan = cache_.plan(id);
    const std::vector<std::int32_t> starts = layout.window_starts(bs_);
    if (static_cast<std::int64_t>(tokens.size()) != cache_.num_tokens(id)) {
      finding("sequence " + std::to_string(id) + ": the harness tracks " + std::to_string(tokens.size()) +
              " tokens, the manager " + std::to_string(cache_.num_tokens(id)));
    }
    for (std::int32_t layer = 0; layer < cache_.config().shape.num_layers; ++layer) {
      std::vector<std::uint8_t> quantized_pos(tokens.size(), 0);
      std::array<std::vector<Tag>, kNumPrecisions> want;
      std::array<std::vector<Tag>, kNumPrecisions> have;
      for (std::size_t w = 0; w < starts.size(); ++w) {
        const Precision p = plan.at(layer, static_cast<std::int32_t>(w));
        if (p == Precision::FP16) continue;
        const auto s = static_cast<std::size_t>(starts[w]);
        want[pool_index(p)].push_back(window_tag(layer_tag(tokens[s], layer)));
        std::fill_n(quantized_pos.begin() + static_cast<std::ptrdiff_t>(s), bs_, 1);
      }
      for (std::size_t pos = 0; pos < tokens.size(); ++pos) {
        if (!quantized_pos[pos]) want[0].push_back(layer_tag(tokens[pos], layer));
      }
      const auto fp16 = cache_.blocks(id, layer, Precision::FP16);
      for (std::size_t b = 0; b < fp16.size(); ++b) {
        const std::int32_t fill = b + 1 == fp16.size() ? cache_.fp16_tail_fill(id, layer) : bs_;
        for (std::int32_t t = 0; t < fill; ++t) have[0].push_back(fp16_slot(fp16[b] * bs_ + t));
      }
      for (const Precision p : {Precision::INT4, Precision::INT2}) {
        for (const std::int32_t b : cache_.blocks(id, layer, p)) have[pool_index(p)].push_back(quantized(p, b));
      }
      std::sort(want[0].begin(), want[0].end());
      std::sort(have[0].begin(), have[0].end());
      for (const Precision p : kAllPrecisions) {
        if (want[pool_index(p)] != have[pool_index(p)]) {
          finding("sequence " + std::to_string(id) + " layer " + std::to_string(layer) + ": its " +
                  std::string(to_string(p)) + " blocks do not hold its tokens (" +
                  std::to_string(have[pool_index(p)].size()) + " entries, expected " +
                  std::to_string(want[pool_index(p)].size()) + "): lost or overwritten");
        }
      }
    }
  }

 private:
  static Tag& at(std::vector<Tag>& v, std::int64_t i, const char* what) {
    if (i < 0 || static_cast<std::size_t>(i) >= v.size()) {
      finding(std::string(what) + " " + std::to_string(i) + " is outside the memory (" + std::to_string(v.size()) +
              " entries)");
    }
    return v[static_cast<std::size_t>(i)];
  }

  const KVCacheManager& cache_;
  std::int32_t bs_;
  std::array<std::vector<Tag>, kNumPrecisions> device_;
  std::array<std::vector<Tag>, kNumPrecisions> host_;
};

// The ranges a fuzzer draws a small cache's config from.
struct ConfigRanges {
  std::int32_t max_layers = 2;
  std::size_t max_blocks_per_slab = 3;  // FP16 blocks a slab holds at most
  std::size_t max_slab_padding = 200;   // bytes past them
  std::size_t max_slabs = 6;
  std::int64_t max_swap_slots = 4;  // per pool
};

// A small, valid cache config drawn from `in` (head_dim and block_size 16 or
// 32, a slab of whole FP16 blocks plus padding, an arena of whole slabs plus
// a partial one).
inline CacheConfig decode_cache_config(FuzzedDataProvider& in, const ConfigRanges& r) {
  CacheConfig c;
  c.shape.num_layers = in.ConsumeIntegralInRange<std::int32_t>(1, r.max_layers);
  c.shape.num_kv_heads = in.ConsumeIntegralInRange<std::int32_t>(1, 2);
  c.shape.head_dim = in.ConsumeBool() ? 32 : 16;
  c.shape.block_size = in.ConsumeBool() ? 32 : 16;
  const std::size_t fp16_block = static_cast<std::size_t>(c.shape.num_kv_heads) * c.shape.head_dim *
                                 static_cast<std::size_t>(c.shape.block_size) * 2 * sizeof(std::uint16_t);
  c.slab_bytes = fp16_block * in.ConsumeIntegralInRange<std::size_t>(1, r.max_blocks_per_slab) +
                 in.ConsumeIntegralInRange<std::size_t>(0, r.max_slab_padding);
  c.arena_bytes = c.slab_bytes * in.ConsumeIntegralInRange<std::size_t>(1, r.max_slabs) +
                  in.ConsumeIntegralInRange<std::size_t>(0, c.slab_bytes - 1);
  for (std::int64_t& slots : c.swap_blocks) slots = in.ConsumeIntegralInRange<std::int64_t>(0, r.max_swap_slots);
  c.fp16_windows_first = in.ConsumeBool();
  return c;
}

// One input of a fuzzer over a cache: a config decoded from the input
// (`decode`), a manager built from it (a refused config ends the input), then
// Harness(in, manager).run() over the rest of the input.
template <typename Harness, typename Decode>
int run_cache_input(const std::uint8_t* data, std::size_t size, Decode decode) {
  ++counters.inputs;
  FuzzedDataProvider in(data, size);
  const CacheConfig config = decode(in);
  std::optional<KVCacheManager> cache;
  if (attempt("KVCacheManager(config)", [&] { cache.emplace(config); }) != Outcome::Ok) return 0;
  Harness(in, *cache).run();
  return 0;
}

}  // namespace mixkv::fuzz
