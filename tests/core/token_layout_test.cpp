#include "mixkv/core/token_layout.h"

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"

namespace mixkv {
namespace {

using test::expect_error;

TEST(TokenLayout, CountsTokensAndWindowsPerVisualSegment) {
  // System text, two frames' worth of visual tokens, a question.
  const TokenLayout layout(
      {{TokenKind::Text, 5}, {TokenKind::Visual, 70}, {TokenKind::Text, 3}, {TokenKind::Visual, 33}});
  EXPECT_EQ(layout.num_tokens(), 111);
  // 70 = 2 windows of 32 + a 6-token tail; 33 = 1 window + 1. Windows never
  // span two visual segments.
  EXPECT_EQ(layout.num_windows(32), 3);
  EXPECT_EQ(layout.window_starts(32), (std::vector<std::int32_t>{5, 37, 78}));
  EXPECT_EQ(layout.num_windows(16), 6);
  EXPECT_EQ(layout.window_starts(16), (std::vector<std::int32_t>{5, 21, 37, 53, 78, 94}));
  EXPECT_EQ(layout.num_windows(1), 103);
}

TEST(TokenLayout, TextOnlyAndShortVisualHaveNoWindows) {
  EXPECT_EQ(TokenLayout({{TokenKind::Text, 100}}).num_windows(32), 0);
  const TokenLayout short_visual({{TokenKind::Visual, 31}});
  EXPECT_EQ(short_visual.num_windows(32), 0);
  EXPECT_TRUE(short_visual.window_starts(32).empty());
  const TokenLayout exact({{TokenKind::Visual, 64}});
  EXPECT_EQ(exact.window_starts(32), (std::vector<std::int32_t>{0, 32}));
}

TEST(TokenLayout, DefaultIsEmpty) {
  const TokenLayout layout;
  EXPECT_EQ(layout.num_tokens(), 0);
  EXPECT_EQ(layout.num_windows(32), 0);
  EXPECT_TRUE(layout.segments().empty());
}

TEST(TokenLayout, Equality) {
  EXPECT_EQ(TokenLayout({{TokenKind::Text, 3}}), TokenLayout({{TokenKind::Text, 3}}));
  EXPECT_NE(TokenLayout({{TokenKind::Text, 3}}), TokenLayout({{TokenKind::Visual, 3}}));
}

TEST(TokenLayout, RejectsBadSegments) {
  expect_error<InvalidArgument>([] { TokenLayout(std::vector<Segment>{}); }, "segments");
  expect_error<InvalidArgument>(
      [] {
        TokenLayout({{TokenKind::Text, 4}, {TokenKind::Visual, 0}});
      },
      "segments[1].length = 0");
  expect_error<InvalidArgument>([] { TokenLayout({{TokenKind::Text, -3}}); }, "segments[0].length = -3");
  expect_error<InvalidArgument>([] { TokenLayout({{static_cast<TokenKind>(7), 4}}); }, "segments[0].kind = 7");
  expect_error<InvalidArgument>(
      [] {
        TokenLayout({{TokenKind::Visual, 1 << 29}, {TokenKind::Visual, 1 << 29}, {TokenKind::Text, 1}});
      },
      "segments[2]");
  const TokenLayout layout({{TokenKind::Visual, 64}});
  expect_error<InvalidArgument>([&] { (void)layout.num_windows(0); }, "window_size = 0");
  expect_error<InvalidArgument>([&] { (void)layout.window_starts(-1); }, "window_size = -1");
}

}  // namespace
}  // namespace mixkv
