#include "mixkv/core/page_table.h"

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;
using test::to_vector;

TEST(PageTable, PacksFp16TokensDensely) {
  PageTable table(2, 16);
  EXPECT_EQ(table.fp16_tail_fill(0), 0);
  EXPECT_EQ(table.fp16_tokens(0), 0);
  table.push_block(0, Precision::FP16, 7, 16);
  table.push_block(0, Precision::FP16, 3, 5);
  table.push_block(0, Precision::INT2, 40, 16);
  table.push_block(1, Precision::INT4, 9, 16);
  EXPECT_EQ(to_vector(table.blocks(0, Precision::FP16)), (std::vector<std::int32_t>{7, 3}));
  EXPECT_EQ(to_vector(table.blocks(0, Precision::INT2)), (std::vector<std::int32_t>{40}));
  EXPECT_TRUE(table.blocks(1, Precision::FP16).empty());
  EXPECT_EQ(table.fp16_tail_fill(0), 5);
  EXPECT_EQ(table.fp16_tokens(0), 21);
  EXPECT_EQ(table.fp16_slot(0, 0), 7 * 16);
  EXPECT_EQ(table.fp16_slot(0, 15), 7 * 16 + 15);
  EXPECT_EQ(table.fp16_slot(0, 16), 3 * 16);
  EXPECT_EQ(table.fp16_slot(0, 20), 3 * 16 + 4);

  EXPECT_EQ(table.fill_fp16_tail(0), 3 * 16 + 5);
  EXPECT_EQ(table.fp16_tail_fill(0), 6);
  table.replace_fp16_tail(0, 11);  // copy-on-write keeps the fill
  EXPECT_EQ(to_vector(table.blocks(0, Precision::FP16)), (std::vector<std::int32_t>{7, 11}));
  EXPECT_EQ(table.fill_fp16_tail(0), 11 * 16 + 6);
}

TEST(PageTable, KeepsOnlyTheTailPartlyFilled) {
  PageTable table(1, 16);
  table.push_block(0, Precision::FP16, 0, 4);
  const PageTable before = table;
  expect_error<InvalidArgument>([&] { table.push_block(0, Precision::FP16, 1, 16); }, "expected a full tail");
  expect_error<InvalidArgument>([&] { table.push_block(0, Precision::INT4, 1, 4); }, "fill = 4");
  expect_error<InvalidArgument>([&] { table.push_block(0, Precision::FP16, 1, 0); }, "fill = 0");
  expect_error<InvalidArgument>([&] { table.push_block(0, Precision::FP16, 1, 17); }, "fill = 17");
  expect_error<InvalidArgument>([&] { table.push_block(0, Precision::FP16, -1, 1); }, "block_id = -1");
  expect_error<InvalidArgument>([&] { table.push_block(0, static_cast<Precision>(4), 1, 16); }, "p = 4");
  expect_error<IndexOutOfRange>([&] { table.push_block(1, Precision::FP16, 1, 1); }, "layer = 1");
  expect_error<IndexOutOfRange>([&] { (void)table.fp16_slot(0, 4); }, "k = 4");
  EXPECT_EQ(table, before);
  for (int i = 0; i < 12; ++i) table.fill_fp16_tail(0);
  expect_error<InvalidArgument>([&] { table.fill_fp16_tail(0); }, "no room");
  PageTable empty(1, 16);
  expect_error<InvalidArgument>([&] { empty.fill_fp16_tail(0); }, "no room");
  expect_error<InvalidArgument>([&] { empty.replace_fp16_tail(0, 3); }, "no FP16 block");
  expect_error<InvalidArgument>([] { PageTable(0, 16); }, "num_layers = 0");
  expect_error<InvalidArgument>([] { PageTable(1, 0); }, "block_size = 0");
}

// The decode fast path keeps one count for all layers; every per-layer
// operation afterwards sees the same fills as token-by-token filling would.
TEST(PageTable, FillsEveryLayerAtOnce) {
  PageTable table(3, 16);
  EXPECT_EQ(table.fp16_room(), 0);  // no FP16 block anywhere
  expect_error<InvalidArgument>([&] { table.fill_all_fp16_tails(); }, "layer 0: the FP16 tail has no room");
  table.open_fp16_tails(std::vector<std::int32_t>{4, 5, 6});
  EXPECT_EQ(to_vector(table.fp16_tails()), (std::vector<std::int32_t>{4, 5, 6}));
  EXPECT_EQ(table.fp16_room(), 15);
  PageTable slow = table;  // the same tokens, one layer at a time
  for (int i = 0; i < 14; ++i) {
    table.fill_all_fp16_tails();
    for (std::int32_t layer = 0; layer < 3; ++layer) slow.fill_fp16_tail(layer);
  }
  EXPECT_EQ(table, slow);
  EXPECT_EQ(table.fp16_tail_fill(2), 15);
  EXPECT_EQ(table.fp16_room(), 1);
  expect_error<InvalidArgument>(
      [&] {
        table.open_fp16_tails(std::vector<std::int32_t>{7, 8, 9});
      },
      "layer 0: the FP16 tail holds 15 of 16 tokens");
  // A per-layer change in between: layer 1's tail fills up first.
  EXPECT_EQ(table.fill_fp16_tail(1), 5 * 16 + 15);
  EXPECT_EQ(table.fp16_room(), 0);
  const PageTable before = table;
  expect_error<InvalidArgument>([&] { table.fill_all_fp16_tails(); }, "layer 1: the FP16 tail has no room");
  EXPECT_EQ(table, before);
  table.fill_fp16_tail(0);
  table.fill_fp16_tail(2);
  const PageTable full = table;
  expect_error<InvalidArgument>(
      [&] {
        table.open_fp16_tails(std::vector<std::int32_t>{7, 8});
      },
      "block_ids.size() = 2");
  expect_error<InvalidArgument>(
      [&] {
        table.open_fp16_tails(std::vector<std::int32_t>{7, -8, 9});
      },
      "block_ids[1] = -8");
  EXPECT_EQ(table, full);
  table.open_fp16_tails(std::vector<std::int32_t>{7, 8, 9});
  EXPECT_EQ(to_vector(table.blocks(1, Precision::FP16)), (std::vector<std::int32_t>{5, 8}));
  EXPECT_EQ(table.fp16_tokens(1), 17);
  table.fill_all_fp16_tails();
  EXPECT_EQ(table.fp16_slot(2, 17), 9 * 16 + 1);
  // Copy-on-write keeps the room; removing a full block resets it.
  table.replace_fp16_tail(0, 10);
  EXPECT_EQ(table.fp16_room(), 14);
  EXPECT_EQ(table.remove_block(1, Precision::FP16, 0), 5);
  EXPECT_EQ(table.fp16_tokens(1), 2);
  EXPECT_EQ(table.fp16_room(), 14);
  EXPECT_EQ(table.fp16_tail_fill(0), 2);
}

}  // namespace
}  // namespace mixkv
