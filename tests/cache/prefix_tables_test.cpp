// prefix_metadata: the page lists of a prompt prefix hold exactly the
// prefix's tokens, in both FP16 packings and every precision mix.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "cache_test_util.h"
#include "mixkv/cache/prefix_tables.h"

namespace mixkv::test {
namespace {

// text 5, visual 16 * 4 + 7 (4 windows and a tail), text 9, visual 32, text 3.
TokenLayout mixed_layout() {
  return TokenLayout({{TokenKind::Text, 5},
                      {TokenKind::Visual, 4 * kTinyBlock + 7},
                      {TokenKind::Text, 9},
                      {TokenKind::Visual, 2 * kTinyBlock},
                      {TokenKind::Text, 3}});
}

// Chunk boundaries: every row not strictly inside a window.
std::vector<std::int32_t> boundaries(const TokenLayout& layout) {
  const auto starts = layout.window_starts(kTinyBlock);
  std::vector<std::int32_t> out;
  for (std::int32_t r = 0; r <= layout.num_tokens(); ++r) {
    const bool inside =
        std::any_of(starts.begin(), starts.end(), [&](std::int32_t s) { return r > s && r < s + kTinyBlock; });
    if (!inside) out.push_back(r);
  }
  return out;
}

// The FP16 slots and quantized blocks a table row lists.
struct Listed {
  std::multiset<std::int32_t> fp16_slots;
  std::vector<std::int32_t> int4, int2;
};

Listed listed(const std::array<PagedPoolTable, kNumPrecisions>& tables, std::size_t i) {
  Listed out;
  const PagedPoolTable& f = tables[pool_index(Precision::FP16)];
  for (std::int32_t j = f.indptr[i]; j < f.indptr[i + 1]; ++j) {
    const bool last = j + 1 == f.indptr[i + 1];
    const std::int32_t fill = last ? f.last_block_len[i] : kTinyBlock;
    for (std::int32_t o = 0; o < fill; ++o) out.fp16_slots.insert(f.indices[j] * kTinyBlock + o);
  }
  for (const Precision p : {Precision::INT4, Precision::INT2}) {
    const PagedPoolTable& t = tables[pool_index(p)];
    auto& dst = p == Precision::INT4 ? out.int4 : out.int2;
    dst.assign(t.indices.begin() + t.indptr[i], t.indices.begin() + t.indptr[i + 1]);
    EXPECT_EQ(t.last_block_len[i], dst.empty() ? 0 : kTinyBlock);
  }
  return out;
}

Listed expected(const StoreMapping& mapping, std::int32_t rows) {
  Listed out;
  for (std::int32_t r = 0; r < rows; ++r) {
    if (mapping.fp16_slots[static_cast<std::size_t>(r)] >= 0)
      out.fp16_slots.insert(mapping.fp16_slots[static_cast<std::size_t>(r)]);
  }
  for (const WindowSlot& w : mapping.int4_windows) {
    if (w.first_row + kTinyBlock <= rows) out.int4.push_back(w.block_id);
  }
  for (const WindowSlot& w : mapping.int2_windows) {
    if (w.first_row + kTinyBlock <= rows) out.int2.push_back(w.block_id);
  }
  return out;
}

class PrefixTables : public ::testing::TestWithParam<bool> {};

TEST_P(PrefixTables, ListExactlyThePrefixAtEveryBoundary) {
  CacheConfig config = tiny_config(3, 64);
  config.fp16_windows_first = GetParam();
  KVCacheManager cache(config);
  const TokenLayout layout = mixed_layout();
  const std::int32_t windows = layout.num_windows(kTinyBlock);
  std::mt19937 rng(7);
  const Precision choices[] = {Precision::FP16, Precision::INT4, Precision::INT2};
  // Two sequences with different random plans; window 0 stays FP16.
  for (SequenceId id : {SequenceId{1}, SequenceId{2}}) {
    PrecisionPlan plan(3, windows);
    for (std::int32_t l = 0; l < 3; ++l) {
      for (std::int32_t w = 1; w < windows; ++w) plan.set(l, w, choices[rng() % 3]);
    }
    cache.add_sequence(id, layout, plan);
  }
  const std::vector<SequenceId> ids{1, 2};
  const std::vector<std::int32_t> cuts = boundaries(layout);
  for (std::size_t k = 0; k < cuts.size(); ++k) {
    // The second sequence at another boundary: batch entries are independent.
    const std::vector<std::int32_t> rows{cuts[k], cuts[(k * 7 + 3) % cuts.size()]};
    const DecodeMetadata meta = prefix_metadata(cache, ids, rows);
    ASSERT_EQ(meta.batch_size, 2);
    ASSERT_EQ(meta.layers.size(), 3u);
    for (std::int32_t l = 0; l < 3; ++l) {
      for (std::size_t i = 0; i < 2; ++i) {
        const Listed got = listed(meta.layers[static_cast<std::size_t>(l)], i);
        const Listed want = expected(cache.prefill_mapping(ids[i], l), rows[i]);
        EXPECT_EQ(got.fp16_slots, want.fp16_slots) << "layer " << l << " seq " << i << " rows " << rows[i];
        EXPECT_EQ(got.int4, want.int4) << "layer " << l << " rows " << rows[i];
        EXPECT_EQ(got.int2, want.int2) << "layer " << l << " rows " << rows[i];
      }
    }
  }
  // The whole prompt is the manager's own page lists.
  const std::vector<std::int32_t> all{layout.num_tokens(), layout.num_tokens()};
  const DecodeMetadata whole = prefix_metadata(cache, ids, all);
  const DecodeMetadata decode = cache.decode_metadata(ids);
  for (std::size_t l = 0; l < 3; ++l) {
    for (std::size_t p = 0; p < kNumPrecisions; ++p) {
      EXPECT_EQ(whole.layers[l][p].indptr, decode.layers[l][p].indptr);
      EXPECT_EQ(whole.layers[l][p].last_block_len, decode.layers[l][p].last_block_len);
      EXPECT_EQ(std::multiset<std::int32_t>(whole.layers[l][p].indices.begin(), whole.layers[l][p].indices.end()),
                std::multiset<std::int32_t>(decode.layers[l][p].indices.begin(), decode.layers[l][p].indices.end()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Packing, PrefixTables, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WindowsFirst" : "PromptOrder"; });

TEST(PrefixTablesBadInput, NamesTheArgument) {
  KVCacheManager cache(tiny_config(2, 64));
  const TokenLayout layout = mixed_layout();
  cache.add_sequence(4, layout, PrecisionPlan(2, layout.num_windows(kTinyBlock), Precision::INT4));
  const std::vector<SequenceId> ids{4};
  expect_error<InvalidArgument>([&] { prefix_metadata(cache, ids, std::vector<std::int32_t>{}); }, "rows");
  expect_error<InvalidArgument>([&] { prefix_metadata(cache, ids, std::vector<std::int32_t>{-1}); }, "rows[0]");
  expect_error<InvalidArgument>(
      [&] { prefix_metadata(cache, ids, std::vector<std::int32_t>{layout.num_tokens() + 1}); }, "rows[0]");
  // Row 6 is inside the first window (rows 5..20).
  expect_error<InvalidArgument>([&] { prefix_metadata(cache, ids, std::vector<std::int32_t>{6}); }, "inside");
  expect_error<UnknownId>([&] { prefix_metadata(cache, std::vector<SequenceId>{9}, std::vector<std::int32_t>{0}); },
                          "9");
}

}  // namespace
}  // namespace mixkv::test
