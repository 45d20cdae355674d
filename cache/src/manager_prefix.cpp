// KVCacheManager: prefix caching. Where a layer's blocks complete along a
// prompt, the match of a prompt against the prefix index, add_sequence with
// shared blocks, and publishing a sequence's stored blocks.
#include "manager_impl.h"

#include <algorithm>
#include <string>
#include <vector>

#include <boost/unordered/unordered_flat_set.hpp>

namespace mixkv {
namespace {

// A block of one layer, in the order blocks complete along the prompt: it
// holds rows up to `end` (exclusive); `begin` is where the previous one
// ended, so consecutive events cover the prompt's rows once. `index` is the
// block's position in the layer's list of its pool. `clean`: no block of
// the layer holds rows on both sides of `end` (the FP16 stream has no open
// block and `end` lies outside every window), so a prefill may start there
// with every block before it shared.
struct BlockEvent {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  Precision precision = Precision::FP16;
  std::int32_t index = 0;
  bool clean = false;
};

// The events of `layer` under `plan`. FP16 tokens form one stream packed
// densely (text, visual tails, FP16 windows in prompt order; with
// fp16_windows_first the FP16 windows are blocks of their own listed first,
// and the stream holds the rest), a stream block completing every
// block_size tokens; a window in a block of its own completes at its end.
void layer_events(const TokenLayout& layout, const PrecisionPlan& plan, std::int32_t layer, std::int32_t bs,
                  bool windows_first, std::vector<BlockEvent>& events) {
  events.clear();
  const std::int64_t window_blocks = windows_first ? plan.window_counts(layer)[0] : 0;
  std::int64_t rank = 0;  // stream tokens so far
  std::int32_t row = 0;
  std::int32_t prev = 0;
  std::array<std::int32_t, kNumPrecisions> next{};
  auto stream = [&](std::int32_t count, bool window) {
    for (std::int64_t k = bs - rank % bs; k <= count; k += bs) {
      const auto end = static_cast<std::int32_t>(row + k);
      const auto index = static_cast<std::int32_t>((rank + k) / bs - 1 + window_blocks);
      events.push_back({prev, end, Precision::FP16, index, !window || k == count});
      prev = end;
    }
    row += count;
    rank += count;
  };
  std::int32_t w = 0;
  for (const Segment& segment : layout.segments()) {
    if (segment.kind == TokenKind::Text) {
      stream(segment.length, false);
      continue;
    }
    const std::int32_t full = segment.length / bs;
    for (std::int32_t i = 0; i < full; ++i, ++w) {
      const Precision p = plan.at(layer, w);
      if (p == Precision::FP16 && !windows_first) {
        stream(bs, true);
        continue;
      }
      row += bs;
      events.push_back({prev, row, p, next[at(p)]++, rank % bs == 0});
      prev = row;
    }
    stream(segment.length - full * bs, false);
  }
}

// Roles of rows [0, limit) of `layer` under `plan` (prefix_index.h); under
// content identity a window's rows name no precision.
void layer_roles(const TokenLayout& layout, const PrecisionPlan& plan, std::int32_t layer, std::int32_t bs,
                 std::int32_t limit, bool content, std::vector<detail::RowRole>& roles) {
  roles.clear();
  std::int32_t w = 0;
  auto add = [&](std::int32_t count, detail::RowRole role) {
    const std::int32_t n = std::min<std::int32_t>(count, limit - static_cast<std::int32_t>(roles.size()));
    roles.insert(roles.end(), static_cast<std::size_t>(std::max(n, 0)), role);
  };
  for (const Segment& segment : layout.segments()) {
    if (segment.kind == TokenKind::Text) {
      add(segment.length, detail::row_role(TokenKind::Text, 0));
      continue;
    }
    const std::int32_t full = segment.length / bs;
    for (std::int32_t i = 0; i < full; ++i, ++w) {
      add(bs, detail::row_role(TokenKind::Visual, content ? 1 : 1 + pool_index(plan.at(layer, w))));
    }
    add(segment.length - full * bs, detail::row_role(TokenKind::Visual, 0));
  }
}

void require_keys(std::span<const TokenKey> keys, std::int32_t tokens, const std::string& rule) {
  if (keys.size() > static_cast<std::size_t>(tokens)) {
    throw InvalidArgument("keys has " + std::to_string(keys.size()) + " entries, expected at most " +
                          std::to_string(tokens) + " (" + rule + ")");
  }
}

// How far below the wanted precisions a child of the walk's node holds the
// rows [child.begin, child.end) whose keys and roles the prompt has there,
// windows at the same or a higher precision: -1 when it does not.
std::int32_t higher_cost(const PrefixNode& child, std::span<const TokenKey> keys,
                         std::span<const detail::RowRole> roles) {
  std::int32_t cost = 0;
  for (std::int32_t r = child.begin; r < child.end; ++r) {
    const auto i = static_cast<std::size_t>(r - child.begin);
    const auto row = static_cast<std::size_t>(r);
    if (child.keys[i] != keys[row]) return -1;
    const detail::RowRole have = child.roles[i];
    const detail::RowRole want = roles[row];
    if (have == want) continue;
    const int h = detail::window_class(have);
    const int w = detail::window_class(want);
    if ((have & 1) != (want & 1) || h == 0 || w == 0 || h > w) return -1;
    cost += w - h;
  }
  return cost;
}

// The event hashes of one prompt, shared by its layers: a layer's i-th
// event hash depends only on the rows, roles and tags of its events 0..i,
// so a layer whose events agree with the memo so far takes its hashes
// (every layer under content identity, and layers with the same plan under
// precision identity) and hashes the rest itself.
class HashMemo {
 public:
  void start_layer() { same_ = true; }
  void diverge() { same_ = false; }
  std::uint64_t hash(std::size_t i, const BlockEvent& e, int tag, std::uint64_t parent, std::span<const TokenKey> keys,
                     std::span<const detail::RowRole> roles) {
    if (same_ && i < entries_.size()) {
      const Entry& m = entries_[i];
      if (m.begin == e.begin && m.end == e.end && m.tag == tag &&
          std::equal(roles.begin(), roles.end(), roles_.begin() + e.begin)) {
        return m.hash;
      }
      same_ = false;
    }
    const std::uint64_t h = PrefixIndex::content_hash(parent, tag, keys, roles);
    if (same_ && i == entries_.size() && static_cast<std::size_t>(e.begin) == roles_.size()) {
      entries_.push_back({e.begin, e.end, tag, h});
      roles_.insert(roles_.end(), roles.begin(), roles.end());
    } else {
      same_ = false;
    }
    return h;
  }

 private:
  struct Entry {
    std::int32_t begin = 0;
    std::int32_t end = 0;
    int tag = 0;
    std::uint64_t hash = 0;
  };
  std::vector<Entry> entries_;
  std::vector<detail::RowRole> roles_;  // [row] of the memo's events
  bool same_ = true;
};

// Content identity: which of `node`'s copies a window takes that `wanted`
// wants at `want` and an unshared prompt would store at `store`
// (KVCacheManager::match_prefix), or nullopt.
std::optional<Precision> copy_for(const PrefixNode& node, Precision want, Precision store,
                                  const PrefixCacheConfig& pc) {
  if (pc.higher == PrefixHigher::Demote && store == Precision::FP16 && node.has(Precision::FP16)) {
    return Precision::FP16;
  }
  if (node.has(want)) return want;
  if (pc.higher == PrefixHigher::Keep && node.has(Precision::FP16)) return Precision::FP16;
  if (pc.share_higher) {
    for (const Precision p : {Precision::INT4, Precision::FP16}) {
      if (bits_of(p) > bits_of(want) && node.has(p)) return p;
    }
  }
  return std::nullopt;
}

}  // namespace

void KVCacheManager::Impl::require_wanted(const PrecisionPlan& plan, const PrecisionPlan& wanted) const {
  if (wanted.num_layers() != plan.num_layers() || wanted.num_windows() != plan.num_windows()) {
    throw InvalidArgument("wanted has " + std::to_string(wanted.num_layers()) + " layers x " +
                          std::to_string(wanted.num_windows()) + " windows, expected the plan's " +
                          std::to_string(plan.num_layers()) + " x " + std::to_string(plan.num_windows()));
  }
}

PrefixShares KVCacheManager::Impl::match(const TokenLayout& layout, const PrecisionPlan& plan,
                                         std::span<const TokenKey> keys, const PrecisionPlan& wanted) const {
  PrefixShares out;
  out.match.plan = plan;
  // The last row is always computed: its output samples the first token.
  const auto limit = static_cast<std::int32_t>(std::min<std::int64_t>(keys.size(), layout.num_tokens() - 1));
  const std::int32_t layers = num_layers();
  const std::int32_t bs = block_size();
  const bool windows_first = config.fp16_windows_first;
  out.match.demand = prompt_demand(layout, plan);
  if (!index || limit <= 0) return out;

  // 1. Each layer's walk down its tree: the nodes that continue the prompt,
  // and the clean rows among their ends. A window held at a higher
  // precision is taken at it (share_higher), which changes the events.
  const std::vector<std::int32_t> starts = layout.window_starts(bs);
  auto window_at = [&](std::int32_t row) {
    const auto it = std::upper_bound(starts.begin(), starts.end(), row);
    return it != starts.begin() && row < *std::prev(it) + bs ? static_cast<std::int32_t>(it - starts.begin() - 1) : -1;
  };
  const bool content = index->content();
  PrecisionPlan taken = plan;
  std::vector<std::vector<const PrefixNode*>> paths(static_cast<std::size_t>(layers));
  std::vector<std::vector<std::int32_t>> clean(static_cast<std::size_t>(layers), std::vector<std::int32_t>{0});
  std::vector<BlockEvent> events;
  std::vector<detail::RowRole> roles;
  HashMemo memo;
  // A layer's walk need not pass the last row clean in the layers before.
  std::int32_t bound = limit;
  for (std::int32_t layer = 0; layer < layers && bound > 0; ++layer) {
    auto& path = paths[static_cast<std::size_t>(layer)];
    layer_events(layout, taken, layer, bs, windows_first, events);
    if (!content) roles.clear();
    memo.start_layer();
    // Roles as far as the walk reads them, doubling: a miss costs O(block).
    auto read_roles = [&](std::int32_t row) {
      if (static_cast<std::int32_t>(roles.size()) >= row) return;
      const auto want = std::max<std::int64_t>(row, 2 * static_cast<std::int64_t>(roles.size()) + 4 * bs);
      layer_roles(layout, taken, layer, bs, static_cast<std::int32_t>(std::min<std::int64_t>(want, bound)), content,
                  roles);
    };
    const PrefixNode* node = &index->root(layer);
    for (std::size_t i = 0; i < events.size() && events[i].end <= bound; ++i) {
      const BlockEvent& e = events[i];
      const auto n = static_cast<std::size_t>(e.end - e.begin);
      read_roles(e.end);
      const auto k = keys.subspan(static_cast<std::size_t>(e.begin), n);
      const auto r = std::span<const detail::RowRole>(roles).subspan(e.begin, n);
      const std::uint64_t hash = memo.hash(i, e, index->tag(e.precision), node->hash, k, r);
      const PrefixNode* next = index->find(*node, e.precision, hash, k, r);
      if (next != nullptr && content) {
        // Positions do not depend on the plan (fp16_windows_first): only
        // the copy taken does. A window event ends at its window's end.
        const std::int32_t w = window_at(e.end - 1);
        const auto got = w >= 0 ? copy_for(*next, wanted.at(layer, w), plan.at(layer, w), config.prefix_cache)
                                : (next->has(Precision::FP16) ? std::optional(Precision::FP16) : std::nullopt);
        if (!got) break;
        if (w >= 0) taken.set(layer, w, *got);
      } else if (next == nullptr && config.prefix_cache.share_higher && !content) {
        std::int32_t best = -1;
        for (const PrefixNode* child : node->children) {
          if (child->end > bound) continue;
          read_roles(child->end);
          const std::int32_t cost = higher_cost(*child, keys, roles);
          if (cost >= 0 && (best < 0 || cost < best)) {
            best = cost;
            next = child;
          }
        }
        if (next != nullptr) {
          for (std::int32_t r = next->begin; r < next->end; ++r) {
            const int cls = detail::window_class(next->roles[static_cast<std::size_t>(r - next->begin)]);
            if (cls > 0) taken.set(layer, window_at(r), static_cast<Precision>(cls - 1));
          }
          layer_events(layout, taken, layer, bs, windows_first, events);
          roles.clear();
          memo.diverge();
          // The prompt now has the child's roles up to its end, so it
          // completes a block there too.
          while (i < events.size() && events[i].end < next->end) ++i;
          if (i == events.size() || events[i].begin != next->begin || events[i].end != next->end) {
            throw InvariantViolation("match_prefix: layer " + std::to_string(layer) +
                                     ": a block taken at a higher precision does not end where the prompt's does");
          }
        }
      }
      if (next == nullptr) break;
      path.push_back(next);
      node = next;
      if (events[i].clean) clean[static_cast<std::size_t>(layer)].push_back(events[i].end);
    }
    bound = clean[static_cast<std::size_t>(layer)].back();
  }

  // 2. The prefix: the last row clean in every layer.
  std::int32_t rows = 0;
  if (bound == 0) return out;
  const auto& first = clean.front();
  for (auto it = first.rbegin(); it != first.rend() && rows == 0; ++it) {
    const bool everywhere = std::all_of(clean.begin(), clean.end(), [&](const std::vector<std::int32_t>& c) {
      return std::binary_search(c.begin(), c.end(), *it);
    });
    if (everywhere) rows = *it;
  }
  if (rows == 0) return out;

  // 3. The plan: windows below the prefix as shared, the rest as asked
  // (no window straddles a clean row). The lists at their final sizes
  // under it, with the shared blocks in place.
  for (std::int32_t layer = 0; layer < layers; ++layer) {
    for (std::size_t w = 0; w < starts.size() && starts[w] + bs <= rows; ++w) {
      out.match.plan.set(layer, static_cast<std::int32_t>(w), taken.at(layer, static_cast<std::int32_t>(w)));
    }
  }
  const PrecisionPlan& final_plan = out.match.plan;
  out.lists.resize(static_cast<std::size_t>(layers));
  BlockCounts shared{};
  for (std::int32_t layer = 0; layer < layers; ++layer) {
    BlockIds& lists = out.lists[static_cast<std::size_t>(layer)];
    const auto windows = final_plan.window_counts(layer);
    const std::int64_t fp16 = layout.num_tokens() - (std::int64_t{windows[1]} + windows[2]) * bs;
    lists[0].assign(static_cast<std::size_t>((fp16 + bs - 1) / bs), -1);
    lists[1].assign(static_cast<std::size_t>(windows[1]), -1);
    lists[2].assign(static_cast<std::size_t>(windows[2]), -1);
    layer_events(layout, final_plan, layer, bs, windows_first, events);
    const auto& path = paths[static_cast<std::size_t>(layer)];
    for (std::size_t k = 0; k < events.size() && events[k].end <= rows; ++k) {
      const BlockEvent& e = events[k];
      if (k >= path.size() || path[k]->end != e.end || !path[k]->has(e.precision)) {
        throw InvariantViolation("match_prefix: layer " + std::to_string(layer) +
                                 ": the shared blocks and the plan's blocks disagree at row " + std::to_string(e.end));
      }
      const std::int32_t block = path[k]->block(e.precision);
      lists[at(e.precision)][static_cast<std::size_t>(e.index)] = block;
      ++shared[at(e.precision)];
      if (pool(e.precision).ref_count(block) == 1) {
        ++out.match.revived[at(e.precision)];
        out.match.revived_ids[at(e.precision)].push_back(block);
      }
    }
  }
  out.match.rows = rows;
  out.match.shared = shared;
  if (content) {
    // Rows computed after a window shared below FP16 read quantized keys.
    for (std::int32_t layer = 0; layer < layers && out.publish_rows > rows; ++layer) {
      for (std::size_t w = 0; w < starts.size() && starts[w] + bs <= rows; ++w) {
        if (final_plan.at(layer, static_cast<std::int32_t>(w)) != Precision::FP16) {
          out.publish_rows = rows;
          break;
        }
      }
    }
  }
  out.match.demand = prompt_demand(layout, final_plan);
  for (const Precision p : kAllPrecisions) out.match.demand[at(p)] -= shared[at(p)];
  return out;
}

PrefixMatch KVCacheManager::match_prefix(const TokenLayout& layout, const PrecisionPlan& plan,
                                         std::span<const TokenKey> keys) const {
  return match_prefix(layout, plan, keys, plan);
}

PrefixMatch KVCacheManager::match_prefix(const TokenLayout& layout, const PrecisionPlan& plan,
                                         std::span<const TokenKey> keys, const PrecisionPlan& wanted) const {
  impl_->require_prompt(layout, plan);
  require_keys(keys, layout.num_tokens(), "one per prompt row at most");
  impl_->require_wanted(plan, wanted);
  return impl_->match(layout, plan, keys, wanted).match;
}

PrefixMatch KVCacheManager::add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan,
                                         std::span<const TokenKey> keys) {
  return add_sequence(id, layout, plan, keys, plan);
}

PrefixMatch KVCacheManager::add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan,
                                         std::span<const TokenKey> keys, const PrecisionPlan& wanted) {
  Impl& m = *impl_;
  if (m.sequences.contains(id)) {
    throw InvalidArgument("id = " + std::to_string(id) + " is already a sequence of this cache, expected a new id");
  }
  m.require_prompt(layout, plan);
  require_keys(keys, layout.num_tokens(), "one per prompt row at most");
  m.require_wanted(plan, wanted);
  PrefixShares shares = m.match(layout, plan, keys, wanted);
  m.add(id, layout, shares.match.plan, &shares);
  if (shares.match.rows > 0) {
    ++m.prefix_hits;
    m.prefix_hit_rows += shares.match.rows;
    for (const Precision p : kAllPrecisions) m.prefix_shared[at(p)] += shares.match.shared[at(p)];
  }
  // Moved, not copied: nothing may allocate once the sequence is added.
  return std::move(shares.match);
}

bool KVCacheManager::can_allocate(const BlockCounts& blocks, const PrefixMatch& match) const {
  const Impl& m = *impl_;
  for (const Precision p : kAllPrecisions) {
    if (blocks[at(p)] < 0) {
      throw InvalidArgument("blocks[" + std::string(to_string(p)) + "] = " + std::to_string(blocks[at(p)]) +
                            ", expected >= 0");
    }
    for (const std::int32_t block : match.revived_ids[at(p)]) {
      const bool cached = m.index && block >= 0 && block < m.pool(p).id_limit() &&
                          m.index->node_of(p, block) != nullptr && m.pool(p).ref_count(block) == 1;
      if (!cached) {
        throw InvalidArgument("match: " + std::string(to_string(p)) + " block " + std::to_string(block) +
                              " is not a cached block no sequence holds, expected a match made since the last change");
      }
    }
  }
  return !m.shortfall(blocks, &match).has_value();
}

std::int64_t KVCacheManager::publish_prefix(SequenceId id, std::span<const TokenKey> keys) {
  Impl& m = *impl_;
  const Sequence& seq = m.resident(id, "id");
  require_keys(keys, seq.prompt->layout.num_tokens(), "the prompt's rows stored so far");
  if (Impl::has_aged(seq)) {
    // Its stream blocks no longer sit where the prompt's layout puts them.
    throw InvalidArgument("id = " + std::to_string(id) +
                          " has demoted stream blocks (age tiers), expected a sequence published before they age");
  }
  if (!m.index || keys.empty()) return 0;
  const TokenLayout& layout = seq.prompt->layout;
  const PrecisionPlan& plan = seq.prompt->plan;
  const bool content = m.index->content();
  const auto limit = static_cast<std::int32_t>(std::min<std::int64_t>(keys.size(), seq.publish_rows));
  const std::int32_t bs = m.block_size();

  // Prepare: every node to link, made in full (std::bad_alloc here leaves
  // the index as it was), every copy to add, then room in the index's maps.
  std::vector<std::unique_ptr<PrefixNode>> made;
  std::vector<std::pair<const PrefixNode*, std::pair<Precision, std::int32_t>>> copies;
  boost::unordered_flat_set<std::pair<std::int32_t, std::uint64_t>> hashes;  // (layer, hash) of `made`
  std::vector<BlockEvent> events;
  std::vector<detail::RowRole> roles;
  HashMemo memo;
  for (std::int32_t layer = 0; layer < m.num_layers(); ++layer) {
    layer_events(layout, plan, layer, bs, m.config.fp16_windows_first, events);
    if (!content || layer == 0) layer_roles(layout, plan, layer, bs, limit, content, roles);
    PrefixNode* node = &m.index->root(layer);
    memo.start_layer();
    for (std::size_t i = 0; i < events.size() && events[i].end <= limit; ++i) {
      const BlockEvent& e = events[i];
      const auto n = static_cast<std::size_t>(e.end - e.begin);
      const auto k = keys.subspan(static_cast<std::size_t>(e.begin), n);
      const auto r = std::span<const detail::RowRole>(roles).subspan(static_cast<std::size_t>(e.begin), n);
      const std::int32_t block = seq.table.blocks(layer, e.precision)[static_cast<std::size_t>(e.index)];
      const std::uint64_t hash = memo.hash(i, e, m.index->tag(e.precision), node->hash, k, r);
      // The same content cached already (this block, or another sequence's
      // copy of it): the chain goes on through it; under content identity
      // this block becomes the node's copy at its precision if it has none.
      if (const PrefixNode* found = m.index->find(*node, e.precision, hash, k, r)) {
        if (content && !found->has(e.precision) && m.index->node_of(e.precision, block) == nullptr) {
          copies.push_back({found, {e.precision, block}});
        }
        node = const_cast<PrefixNode*>(found);
        continue;
      }
      // A taken hash (another content's) or a block filed under other
      // content (its rows before changed precision since) ends the chain.
      if (m.index->hash_taken(layer, hash) || hashes.contains({layer, hash}) ||
          m.index->node_of(e.precision, block) != nullptr) {
        break;
      }
      made.push_back(m.index->make(*node, e.precision, block, e.begin, hash, k, r));
      hashes.insert({layer, hash});
      node = made.back().get();
    }
  }
  m.index->reserve(made.size(), made.size() + copies.size());
  // Commit: links and retains, allocating nothing.
  for (auto& node : made) m.index->link(std::move(node));
  for (const auto& [node, copy] : copies) m.index->add_copy(*node, copy.first, copy.second);
  const auto added = static_cast<std::int64_t>(made.size() + copies.size());
  m.prefix_published += added;
  return added;
}

std::int64_t KVCacheManager::evict_prefix_cache() {
  Impl& m = *impl_;
  if (!m.index) return 0;
  const std::int64_t before = m.index->evictable_total();
  while (m.index->evict_one()) {
  }
  return before;
}

PrefixCacheStats KVCacheManager::prefix_stats() const {
  const Impl& m = *impl_;
  PrefixCacheStats st;
  if (m.index) {
    st.cached = m.index->cached();
    st.evictable = m.index->evictable();
    st.evicted = m.index->evicted();
  }
  st.published = m.prefix_published;
  st.hits = m.prefix_hits;
  st.hit_rows = m.prefix_hit_rows;
  st.shared = m.prefix_shared;
  return st;
}

}  // namespace mixkv
