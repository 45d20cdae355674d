// The prefix index: nodes, their content hashes, the LRU list of blocks no
// sequence holds, eviction, and the index's own invariants.
#include "prefix_index.h"

#include <algorithm>
#include <string>

#include "mixkv/core/errors.h"
#include "mixkv/core/hash.h"

namespace mixkv::detail {
namespace {

std::uint64_t step(std::uint64_t h, std::uint64_t x) { return mix64(h ^ (x + 0x9E3779B97F4A7C15ULL + (h << 6))); }

constexpr std::uint64_t kRootHash = 0x70726566697821ULL;

std::string where(const PrefixNode& n) {
  return "prefix index: layer " + std::to_string(n.layer) + " node of rows [" + std::to_string(n.begin) + ", " +
         std::to_string(n.end) + ") ";
}

}  // namespace

PrefixNode::PrefixNode() {
  for (const Precision p : kAllPrecisions) {
    PrefixCopy& c = copies[static_cast<std::size_t>(pool_index(p))];
    c.node = this;
    c.precision = p;
  }
}

int PrefixNode::num_copies() const {
  return static_cast<int>(
      std::count_if(copies.begin(), copies.end(), [](const PrefixCopy& c) { return c.block >= 0; }));
}

PrefixIndex::PrefixIndex(std::int32_t num_layers, std::array<BlockPool*, kNumPrecisions> pools, PrefixIdentity identity)
    : pools_(pools), identity_(identity), roots_(static_cast<std::size_t>(num_layers)) {
  for (std::int32_t l = 0; l < num_layers; ++l) {
    roots_[static_cast<std::size_t>(l)].layer = l;
    roots_[static_cast<std::size_t>(l)].hash = kRootHash;
  }
}

PrefixIndex::~PrefixIndex() {
  // The nodes die with the maps; the LRU list must not outlive its hooks.
  lru_.clear();
}

std::uint64_t PrefixIndex::content_hash(std::uint64_t parent, int tag, std::span<const TokenKey> keys,
                                        std::span<const RowRole> roles) {
  std::uint64_t h = step(parent, static_cast<std::uint64_t>(tag) + (std::uint64_t{keys.size()} << 8));
  for (std::size_t i = 0; i < keys.size(); ++i) h = step(step(h, keys[i]), roles[i]);
  return h;
}

std::uint64_t PrefixIndex::node_key(std::int32_t layer, std::uint64_t hash) {
  return hash ^ mix64(0x6c61796572ULL + static_cast<std::uint64_t>(layer));
}

const PrefixNode* PrefixIndex::find(const PrefixNode& parent, Precision p, std::uint64_t hash,
                                    std::span<const TokenKey> keys, std::span<const RowRole> roles) const {
  const auto it = by_hash_.find(node_key(parent.layer, hash));
  if (it == by_hash_.end()) return nullptr;
  const PrefixNode& n = *it->second;
  // Verified key by key: equal hashes of different content never share.
  const bool same = n.parent == &parent && (content() || n.has(p)) && std::ranges::equal(n.keys, keys) &&
                    std::ranges::equal(n.roles, roles);
  return same ? &n : nullptr;
}

const PrefixNode* PrefixIndex::node_of(Precision p, std::int32_t block) const {
  const auto it = by_block_.find(block_key(p, block));
  return it == by_block_.end() ? nullptr : it->second->node;
}

std::unique_ptr<PrefixNode> PrefixIndex::make(PrefixNode& parent, Precision p, std::int32_t block, std::int32_t begin,
                                              std::uint64_t hash, std::span<const TokenKey> keys,
                                              std::span<const RowRole> roles) const {
  auto node = std::make_unique<PrefixNode>();
  node->parent = &parent;
  node->layer = parent.layer;
  node->begin = begin;
  node->end = begin + static_cast<std::int32_t>(keys.size());
  node->keys.assign(keys.begin(), keys.end());
  node->roles.assign(roles.begin(), roles.end());
  node->hash = hash;
  node->copies[static_cast<std::size_t>(pool_index(p))].block = block;  // taken by link()
  // A parent gets at most one new child per call (a layer's chain is a path).
  parent.children.reserve(parent.children.size() + 1);
  return node;
}

void PrefixIndex::reserve(std::size_t nodes, std::size_t copies) {
  by_hash_.reserve(by_hash_.size() + nodes);
  by_block_.reserve(by_block_.size() + copies);
}

void PrefixIndex::take_copy(PrefixCopy& copy, std::int32_t block) {
  copy.block = block;
  by_block_.emplace(block_key(copy.precision, block), &copy);
  pool(copy.precision).retain(block);
  set_evictable(copy, pool(copy.precision).ref_count(block) == 1);
}

void PrefixIndex::link(std::unique_ptr<PrefixNode> node) {
  PrefixNode* n = node.get();
  n->parent->children.push_back(n);
  by_hash_.emplace(node_key(n->layer, n->hash), std::move(node));
  for (PrefixCopy& c : n->copies) {
    if (c.block >= 0) take_copy(c, c.block);
  }
}

void PrefixIndex::add_copy(const PrefixNode& node, Precision p, std::int32_t block) {
  PrefixNode& n = const_cast<PrefixNode&>(node);  // the index's own node
  take_copy(n.copies[static_cast<std::size_t>(pool_index(p))], block);
}

void PrefixIndex::holders_changed(Precision p, std::int32_t block) {
  const auto it = by_block_.find(block_key(p, block));
  if (it != by_block_.end()) set_evictable(*it->second, pool(p).ref_count(block) == 1);
}

void PrefixIndex::set_evictable(PrefixCopy& copy, bool evictable) {
  if (evictable == copy.hook.is_linked()) return;
  if (evictable) {
    lru_.push_back(copy);
  } else {
    lru_.erase(lru_.iterator_to(copy));
  }
  evictable_[static_cast<std::size_t>(pool_index(copy.precision))] += evictable ? 1 : -1;
}

BlockCounts PrefixIndex::cached() const {
  BlockCounts counts{};
  for (const auto& [key, copy] : by_block_) ++counts[static_cast<std::size_t>(pool_index(copy->precision))];
  return counts;
}

void PrefixIndex::remove_copy(PrefixCopy& copy) {
  set_evictable(copy, false);
  const Precision p = copy.precision;
  pool(p).release(copy.block);
  ++evicted_[static_cast<std::size_t>(pool_index(p))];
  by_block_.erase(block_key(p, copy.block));
  copy.block = -1;
}

void PrefixIndex::remove_leaf(PrefixNode& node) {
  for (PrefixCopy& c : node.copies) {
    if (c.block >= 0) remove_copy(c);
  }
  std::vector<PrefixNode*>& siblings = node.parent->children;
  siblings.erase(std::find(siblings.begin(), siblings.end(), &node));
  const std::uint64_t key = node_key(node.layer, node.hash);
  by_hash_.erase(key);  // destroys the node: last
}

bool PrefixIndex::evict_one() {
  if (lru_.empty()) return false;
  PrefixCopy& front = lru_.front();
  PrefixNode* top = front.node;
  if (top->num_copies() > 1) {
    // Its other copies still hold the content the subtree continues.
    remove_copy(front);
    return true;
  }
  // Post-order through the subtree, by the children lists themselves:
  // nothing to allocate.
  PrefixNode* n = top;
  for (;;) {
    while (!n->children.empty()) n = n->children.back();
    PrefixNode* up = n->parent;
    const bool last = n == top;
    remove_leaf(*n);
    if (last) return true;
    n = up;
  }
}

void PrefixIndex::check() const {
  auto fail = [](const std::string& what) { throw InvariantViolation(what); };
  for (std::size_t l = 0; l < roots_.size(); ++l) {
    const PrefixNode& r = roots_[l];
    if (r.parent != nullptr || r.num_copies() != 0 || r.end != 0 || r.hash != kRootHash ||
        r.layer != static_cast<std::int32_t>(l)) {
      fail("prefix index: the root of layer " + std::to_string(l) + " is not a bare root");
    }
    for (const PrefixNode* child : r.children) {
      if (child->parent != &r)
        fail("prefix index: a child of layer " + std::to_string(l) + "'s root names another parent");
    }
  }
  BlockCounts evictable{};
  std::size_t linked = 0;
  std::size_t copies = 0;
  for (const auto& [key, owned] : by_hash_) {
    const PrefixNode& n = *owned;
    const std::string at = where(n);
    if (key != node_key(n.layer, n.hash)) fail(at + "is filed under another hash");
    if (n.parent == nullptr) fail(at + "has no parent");
    if (n.layer != n.parent->layer || n.begin != n.parent->end || n.end <= n.begin ||
        n.keys.size() != static_cast<std::size_t>(n.end - n.begin) || n.roles.size() != n.keys.size()) {
      fail(at + "does not continue its parent's rows (parent ends at " + std::to_string(n.parent->end) + ")");
    }
    if (std::count(n.parent->children.begin(), n.parent->children.end(), &n) != 1) {
      fail(at + "is not listed once among its parent's children");
    }
    for (const PrefixNode* child : n.children) {
      if (child->parent != &n) fail(at + "lists a child that names another parent");
    }
    const int held = n.num_copies();
    if (held == 0 || (!content() && held != 1)) {
      fail(at + "holds " + std::to_string(held) + " copies, expected " + (content() ? "at least 1" : "1"));
    }
    // Reachable: the parent chain ends at this layer's root.
    const PrefixNode* up = &n;
    for (std::size_t steps = 0; up->parent != nullptr && steps <= by_hash_.size(); ++steps) up = up->parent;
    if (up != &roots_[static_cast<std::size_t>(n.layer)]) fail(at + "is not reachable from its layer's root");
    for (const PrefixCopy& c : n.copies) {
      if (c.node != &n) fail(at + "has a copy that names another node");
      if (c.block < 0) {
        if (c.hook.is_linked()) fail(at + "lists a missing " + std::string(to_string(c.precision)) + " copy as LRU");
        continue;
      }
      ++copies;
      const std::string copy_at = at + std::string(to_string(c.precision)) + " block " + std::to_string(c.block) + " ";
      if (!content() && n.hash != content_hash(n.parent->hash, tag(c.precision), n.keys, n.roles)) {
        fail(copy_at + "has a stale hash");
      }
      const auto b = by_block_.find(block_key(c.precision, c.block));
      if (b == by_block_.end() || b->second != &c) fail(copy_at + "is filed under another block");
      const std::int32_t refs = pool(c.precision).ref_count(c.block);
      if (refs < 1) fail(copy_at + "is free in its pool");
      if (c.hook.is_linked() != (refs == 1)) {
        fail(copy_at + "has " + std::to_string(refs) + " holders but is " + (c.hook.is_linked() ? "" : "not ") +
             "on the LRU list (only blocks no sequence holds are)");
      }
      if (c.hook.is_linked()) {
        ++linked;
        ++evictable[static_cast<std::size_t>(pool_index(c.precision))];
      }
    }
    if (content() && n.hash != content_hash(n.parent->hash, kNumPrecisions, n.keys, n.roles)) {
      fail(at + "has a stale hash");
    }
  }
  if (copies != by_block_.size()) {
    fail("prefix index: " + std::to_string(by_block_.size()) + " blocks filed for " + std::to_string(copies) +
         " copies");
  }
  std::size_t walked = 0;
  for (const PrefixCopy& c : lru_) {
    if (c.block < 0 || node_of(c.precision, c.block) != c.node) {
      fail("prefix index: the LRU list holds a copy the index does not");
    }
    if (++walked > by_block_.size()) fail("prefix index: the LRU list is longer than the index");
  }
  if (walked != linked || evictable != evictable_) {
    fail("prefix index: " + std::to_string(walked) + " copies on the LRU list, " + std::to_string(linked) +
         " linked, counts per pool " + std::to_string(evictable_[0]) + "/" + std::to_string(evictable_[1]) + "/" +
         std::to_string(evictable_[2]) + " recorded");
  }
}

void PrefixIndex::describe(std::string& out) const {
  auto put = [&out](const char* label, std::int64_t value) {
    out += label;
    out += std::to_string(value);
  };
  put("prefix index: nodes ", static_cast<std::int64_t>(by_hash_.size()));
  put(" copies ", static_cast<std::int64_t>(by_block_.size()));
  out += "\n";
  // Depth first, children in the order they were indexed.
  std::vector<const PrefixNode*> stack;
  for (const PrefixNode& root : roots_) {
    for (auto it = root.children.rbegin(); it != root.children.rend(); ++it) stack.push_back(*it);
    while (!stack.empty()) {
      const PrefixNode& n = *stack.back();
      stack.pop_back();
      put("  layer ", n.layer);
      put(" rows ", n.begin);
      put("-", n.end);
      out += " hash ";
      out += std::to_string(n.hash);
      for (const PrefixCopy& c : n.copies) {
        if (c.block < 0) continue;
        out += ' ';
        out += to_string(c.precision);
        put(":", c.block);
        put(" refs ", pool(c.precision).ref_count(c.block));
      }
      out += "\n";
      for (auto it = n.children.rbegin(); it != n.children.rend(); ++it) stack.push_back(*it);
    }
  }
  out += "  lru:";
  for (const PrefixCopy& c : lru_) {
    out += ' ';
    out += to_string(c.precision);
    put(":", c.block);
  }
  out += "\n";
}

}  // namespace mixkv::detail
