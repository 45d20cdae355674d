// Age tiers on the CPU engine: a decode after tier demotions reads exactly
// what store() writes for the same windows at that precision. Run A serves
// a text request with tiers on; for a decode at position P, run B (tiers
// off) stores the first P tokens as a prompt whose windows carry the
// precisions A's blocks had then, through store(), and decodes position P:
// every quantized block and every attention output are bit-identical.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "mixkv/core/half.h"
#include "mixkv/core/hash.h"
#include "mixkv/engine/cpu_backend.h"
#include "mixkv/engine/engine.h"

namespace mixkv {
namespace {

constexpr std::int32_t kLayers = 2;
constexpr std::int32_t kHeads = 2;   // KV heads
constexpr std::int32_t kQHeads = 4;  // GQA 2:1
constexpr std::int32_t kDim = 64;
constexpr std::int32_t kBs = 32;
const std::vector<Precision> kTiers{Precision::INT4, Precision::INT2};
constexpr std::int32_t kRecent = 1;  // sink_windows = 1

// A value in [-2, 2) of (position, layer, head, channel, what): the same
// token has the same K/V/q in both runs.
Half value(std::int64_t pos, std::int32_t layer, std::int32_t head, std::int32_t c, std::uint64_t what) {
  const std::uint64_t k = mix64((static_cast<std::uint64_t>(pos) << 24) ^ (static_cast<std::uint64_t>(layer) << 16) ^
                                (static_cast<std::uint64_t>(head) << 8) ^ static_cast<std::uint64_t>(c) ^ (what << 40));
  return float_to_half(static_cast<float>(static_cast<double>(k >> 11) / 9007199254740992.0 * 4.0 - 2.0));
}

std::vector<Half> rows(std::int64_t from, std::int64_t to, std::int32_t layer, std::int32_t heads, std::uint64_t what) {
  std::vector<Half> out;
  for (std::int64_t p = from; p < to; ++p) {
    for (std::int32_t h = 0; h < heads; ++h) {
      for (std::int32_t c = 0; c < kDim; ++c) out.push_back(value(p, layer, h, c, what));
    }
  }
  return out;
}

TensorView view(const void* data, DType dtype, std::int64_t a, std::int64_t b) {
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = 3;
  t.shape[0] = a;
  t.shape[1] = b;
  t.shape[2] = kDim;
  return t;
}

EngineConfig config(bool tiers) {
  EngineConfig c;
  c.cache.shape = CacheShape{kLayers, kHeads, kDim, kBs};
  c.cache.slab_bytes = 64 << 10;
  c.cache.arena_bytes = 64 * c.cache.slab_bytes;
  c.cache.fp16_windows_first = true;
  c.scheduler.max_num_seqs = 4;
  c.scheduler.max_num_batched_tokens = 512;
  c.scheduler.watermark = 0.0;
  c.scheduler.age_tiers.enabled = tiers;
  c.scheduler.age_tiers.recent_windows = kRecent;
  c.scheduler.age_tiers.layer_floor = kTiers;
  c.num_q_heads = kQHeads;
  return c;
}

// Decode outputs ((position, layer) -> FP16 bits) and, at the decode of
// each position, the bytes of every quantized block ([layer][pool] in list
// order) the request held.
struct Served {
  std::map<std::pair<std::int64_t, std::int32_t>, std::vector<std::uint16_t>> outputs;
  std::map<std::int64_t, std::vector<std::vector<std::byte>>> quantized;
};

std::vector<std::vector<std::byte>> quantized_bytes(Engine& engine, RequestId id) {
  const auto& cpu = dynamic_cast<const CpuBackend&>(engine.backend());
  const PoolViews pools = cpu.arena_pools();
  std::vector<std::vector<std::byte>> out;
  for (std::int32_t layer = 0; layer < kLayers; ++layer) {
    for (const Precision p : {Precision::INT4, Precision::INT2}) {
      std::vector<std::byte> bytes;
      const PoolView& pool = pools[static_cast<std::size_t>(pool_index(p))];
      for (const std::int32_t b : engine.cache().blocks(id, layer, p)) {
        const std::byte* at = pool.block(b);
        bytes.insert(bytes.end(), at, at + pool.format.block_bytes());
      }
      out.push_back(std::move(bytes));
    }
  }
  return out;
}

// Serves `request` to its end: prompt rows through store(), decodes
// through attend().
Served serve(Engine& engine, const Request& request) {
  Served run;
  engine.add_request(request);
  while (engine.has_unfinished()) {
    const StepOutput& s = engine.step();
    std::int64_t pos = -1;
    if (!s.decodes.empty()) {
      pos = engine.cache().num_tokens(request.id) - 1;
      run.quantized[pos] = quantized_bytes(engine, request.id);
    }
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      for (const PrefillChunk& chunk : s.prefills) {
        const auto k = rows(chunk.start, chunk.end, layer, kHeads, 1);
        const auto v = rows(chunk.start, chunk.end, layer, kHeads, 2);
        const std::int64_t n = chunk.end - chunk.start;
        engine.store(layer, view(k.data(), DType::F16, n, kHeads), view(v.data(), DType::F16, n, kHeads));
      }
      if (s.decodes.empty()) continue;
      const auto q = rows(pos, pos + 1, layer, kQHeads, 3);
      const auto k = rows(pos, pos + 1, layer, kHeads, 1);
      const auto v = rows(pos, pos + 1, layer, kHeads, 2);
      std::vector<Half> o(q.size());
      engine.attend(layer, view(q.data(), DType::F16, 1, kQHeads), view(k.data(), DType::F16, 1, kHeads),
                    view(v.data(), DType::F16, 1, kHeads), view(o.data(), DType::F16, 1, kQHeads));
      std::vector<std::uint16_t>& bits = run.outputs[{pos, layer}];
      bits.resize(o.size());
      std::memcpy(bits.data(), o.data(), o.size() * sizeof(Half));
    }
  }
  return run;
}

TEST(EngineAgeTiers, DecodeAfterTierDemotionEqualsStoreAtThatPrecision) {
  Engine tiered(config(true));
  Request a;
  a.id = 1;
  a.layout = TokenLayout({{TokenKind::Text, 40}});
  a.max_new_tokens = 160;
  const Served run_a = serve(tiered, a);
  ASSERT_GT(tiered.scheduler().stats().age_demotions, 0);
  int compared = 0;
  // Positions at and around block boundaries, and where INT2 and INT4 mix.
  for (const std::int64_t pos : {40, 95, 96, 97, 127, 128, 150, 191, 192, 198}) {
    // What A held when it decoded `pos`: stream block w of the first pos
    // tokens at the tier once kRecent * kBs tokens follow it (not block 0).
    const std::int32_t windows = static_cast<std::int32_t>(pos / kBs);
    std::vector<Segment> segments{{TokenKind::Visual, windows * kBs}};
    if (pos % kBs != 0) segments.push_back({TokenKind::Text, static_cast<std::int32_t>(pos % kBs)});
    Request b;
    b.id = 1;
    b.layout = TokenLayout(segments);
    PrecisionPlan plan(kLayers, windows);
    for (std::int32_t w = 1; w < windows; ++w) {
      const bool old = pos - 1 - (std::int64_t{w} * kBs + kBs - 1) >= kRecent * kBs;
      for (std::int32_t l = 0; l < kLayers; ++l)
        plan.set(l, w, old ? kTiers[static_cast<std::size_t>(l)] : Precision::FP16);
    }
    b.plan = plan;
    b.max_new_tokens = 2;  // one decode: position pos
    Engine stored(config(false));
    const Served run_b = serve(stored, b);
    ASSERT_TRUE(run_b.quantized.contains(pos));
    EXPECT_EQ(run_a.quantized.at(pos), run_b.quantized.at(pos)) << "quantized blocks at position " << pos;
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(run_a.outputs.at({pos, layer}), run_b.outputs.at({pos, layer}))
          << "position " << pos << " layer " << layer;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 20);
}

}  // namespace
}  // namespace mixkv
