#include "mixkv/cache/page_table.h"

#include <gtest/gtest.h>

#include "cache_test_util.h"

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

}  // namespace
}  // namespace mixkv
