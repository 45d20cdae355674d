#include "mixkv/core/token_layout.h"

#include <string>
#include <utility>

#include "mixkv/core/errors.h"

namespace mixkv {
namespace {

// Prompt positions are int32 everywhere (slot mappings, window rows); 2^30
// leaves headroom for generated tokens.
constexpr std::int64_t kMaxPromptTokens = std::int64_t{1} << 30;

void require_window_size(std::int32_t window_size) {
  if (window_size < 1) {
    throw InvalidArgument("window_size = " + std::to_string(window_size) + ", expected >= 1");
  }
}

}  // namespace

TokenLayout::TokenLayout(std::vector<Segment> segments) {
  if (segments.empty()) throw InvalidArgument("segments is empty, expected at least one segment");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const std::string name = "segments[" + std::to_string(i) + "]";
    if (s.kind != TokenKind::Text && s.kind != TokenKind::Visual) {
      throw InvalidArgument(name + ".kind = " + std::to_string(static_cast<int>(s.kind)) +
                            ", expected Text (0) or Visual (1)");
    }
    if (s.length < 1) {
      throw InvalidArgument(name + ".length = " + std::to_string(s.length) + ", expected >= 1");
    }
    total += s.length;
    if (total > kMaxPromptTokens) {
      throw InvalidArgument(name + ": prompt reaches " + std::to_string(total) + " tokens, expected at most " +
                            std::to_string(kMaxPromptTokens) + " in total");
    }
  }
  segments_ = std::move(segments);
  num_tokens_ = static_cast<std::int32_t>(total);
}

std::int32_t TokenLayout::num_windows(std::int32_t window_size) const {
  require_window_size(window_size);
  std::int32_t windows = 0;
  for (const Segment& s : segments_) {
    if (s.kind == TokenKind::Visual) windows += s.length / window_size;
  }
  return windows;
}

std::vector<std::int32_t> TokenLayout::window_starts(std::int32_t window_size) const {
  require_window_size(window_size);
  std::vector<std::int32_t> starts;
  starts.reserve(static_cast<std::size_t>(num_windows(window_size)));
  std::int32_t position = 0;
  for (const Segment& s : segments_) {
    if (s.kind == TokenKind::Visual) {
      for (std::int32_t w = 0; w + window_size <= s.length; w += window_size) starts.push_back(position + w);
    }
    position += s.length;
  }
  return starts;
}

}  // namespace mixkv
