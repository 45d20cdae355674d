#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace mixkv {

enum class TokenKind : std::uint8_t { Text = 0, Visual = 1 };

struct Segment {
  TokenKind kind = TokenKind::Text;
  std::int32_t length = 0;
  friend bool operator==(const Segment&, const Segment&) = default;
};

// The prompt of one request as ordered runs of text and visual tokens, e.g.
// (system text, 19,600 visual tokens, question). Each visual segment is cut
// into windows of window_size tokens from its own start; a visual tail shorter
// than a window stays FP16, as text does (windowquant.md, section 1).
class TokenLayout {
 public:
  TokenLayout() = default;
  // Throws InvalidArgument ("segments[i].length ...") for a length < 1 or a
  // total over 2^30 tokens, and for an empty list.
  explicit TokenLayout(std::vector<Segment> segments);

  std::span<const Segment> segments() const { return segments_; }
  std::int32_t num_tokens() const { return num_tokens_; }

  // Full visual windows, in prompt order.
  std::int32_t num_windows(std::int32_t window_size) const;
  // Prompt index of each window's first token (size num_windows()).
  std::vector<std::int32_t> window_starts(std::int32_t window_size) const;

  friend bool operator==(const TokenLayout&, const TokenLayout&) = default;

 private:
  std::vector<Segment> segments_;
  std::int32_t num_tokens_ = 0;
};

}  // namespace mixkv
