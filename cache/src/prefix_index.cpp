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

std::uint64_t root_hash(std::int32_t layer) { return mix64(0x70726566697821ULL + static_cast<std::uint64_t>(layer)); }

std::string where(const PrefixNode& n) {
  return "prefix index: layer " + std::to_string(n.layer) + " " + std::string(to_string(n.precision)) + " block " +
         std::to_string(n.block) + " (rows [" + std::to_string(n.begin) + ", " + std::to_string(n.end) + ")) ";
}

}  // namespace

PrefixIndex::PrefixIndex(std::int32_t num_layers, std::array<BlockPool*, kNumPrecisions> pools)
    : pools_(pools), roots_(static_cast<std::size_t>(num_layers)) {
  for (std::int32_t l = 0; l < num_layers; ++l) {
    roots_[static_cast<std::size_t>(l)].layer = l;
    roots_[static_cast<std::size_t>(l)].hash = root_hash(l);
  }
}

PrefixIndex::~PrefixIndex() {
  // The nodes die with the maps; the LRU list must not outlive its hooks.
  lru_.clear();
}

std::uint64_t PrefixIndex::content_hash(std::uint64_t parent, Precision p, std::span<const TokenKey> keys,
                                        std::span<const RowRole> roles) {
  std::uint64_t h = step(parent, static_cast<std::uint64_t>(pool_index(p)) + (std::uint64_t{keys.size()} << 8));
  for (std::size_t i = 0; i < keys.size(); ++i) h = step(step(h, keys[i]), roles[i]);
  return h;
}

const PrefixNode* PrefixIndex::find(const PrefixNode& parent, Precision p, std::span<const TokenKey> keys,
                                    std::span<const RowRole> roles) const {
  const auto it = by_hash_.find(content_hash(parent.hash, p, keys, roles));
  if (it == by_hash_.end()) return nullptr;
  const PrefixNode& n = *it->second;
  // Verified key by key: equal hashes of different content never share.
  const bool same =
      n.parent == &parent && n.precision == p && std::ranges::equal(n.keys, keys) && std::ranges::equal(n.roles, roles);
  return same ? &n : nullptr;
}

const PrefixNode* PrefixIndex::node_of(Precision p, std::int32_t block) const {
  const auto it = by_block_.find(block_key(p, block));
  return it == by_block_.end() ? nullptr : it->second.get();
}

std::unique_ptr<PrefixNode> PrefixIndex::make(PrefixNode& parent, Precision p, std::int32_t block, std::int32_t begin,
                                              std::span<const TokenKey> keys, std::span<const RowRole> roles) const {
  auto node = std::make_unique<PrefixNode>();
  node->parent = &parent;
  node->layer = parent.layer;
  node->precision = p;
  node->block = block;
  node->begin = begin;
  node->end = begin + static_cast<std::int32_t>(keys.size());
  node->keys.assign(keys.begin(), keys.end());
  node->roles.assign(roles.begin(), roles.end());
  node->hash = content_hash(parent.hash, p, keys, roles);
  // A parent gets at most one new child per call (a layer's chain is a path).
  parent.children.reserve(parent.children.size() + 1);
  return node;
}

void PrefixIndex::reserve(std::size_t count) {
  by_hash_.reserve(by_hash_.size() + count);
  by_block_.reserve(by_block_.size() + count);
}

void PrefixIndex::link(std::unique_ptr<PrefixNode> node) {
  PrefixNode* n = node.get();
  by_hash_.emplace(n->hash, n);
  by_block_.emplace(block_key(n->precision, n->block), std::move(node));
  n->parent->children.push_back(n);
  pool(n->precision).retain(n->block);
  set_evictable(*n, pool(n->precision).ref_count(n->block) == 1);
}

void PrefixIndex::holders_changed(Precision p, std::int32_t block) {
  const auto it = by_block_.find(block_key(p, block));
  if (it != by_block_.end()) set_evictable(*it->second, pool(p).ref_count(block) == 1);
}

void PrefixIndex::set_evictable(PrefixNode& node, bool evictable) {
  if (evictable == node.hook.is_linked()) return;
  if (evictable) {
    lru_.push_back(node);
  } else {
    lru_.erase(lru_.iterator_to(node));
  }
  evictable_[static_cast<std::size_t>(pool_index(node.precision))] += evictable ? 1 : -1;
}

BlockCounts PrefixIndex::cached() const {
  BlockCounts counts{};
  for (const auto& [key, node] : by_block_) ++counts[static_cast<std::size_t>(pool_index(node->precision))];
  return counts;
}

void PrefixIndex::remove_leaf(PrefixNode& node) {
  set_evictable(node, false);
  std::vector<PrefixNode*>& siblings = node.parent->children;
  siblings.erase(std::find(siblings.begin(), siblings.end(), &node));
  by_hash_.erase(node.hash);
  const Precision p = node.precision;
  pool(p).release(node.block);
  ++evicted_[static_cast<std::size_t>(pool_index(p))];
  by_block_.erase(block_key(p, node.block));  // destroys the node: last
}

bool PrefixIndex::evict_one() {
  if (lru_.empty()) return false;
  // Post-order through the subtree, by the children lists themselves:
  // nothing to allocate.
  PrefixNode* top = &lru_.front();
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
    if (r.parent != nullptr || r.block != -1 || r.end != 0 || r.hash != root_hash(static_cast<std::int32_t>(l)) ||
        r.hook.is_linked()) {
      fail("prefix index: the root of layer " + std::to_string(l) + " is not a bare root");
    }
    for (const PrefixNode* child : r.children) {
      if (child->parent != &r)
        fail("prefix index: a child of layer " + std::to_string(l) + "'s root names another parent");
    }
  }
  if (by_hash_.size() != by_block_.size()) {
    fail("prefix index: " + std::to_string(by_hash_.size()) + " hashes for " + std::to_string(by_block_.size()) +
         " nodes");
  }
  BlockCounts evictable{};
  std::size_t linked = 0;
  for (const auto& [key, owned] : by_block_) {
    const PrefixNode& n = *owned;
    const std::string at = where(n);
    if (key != block_key(n.precision, n.block) || n.block < 0) fail(at + "is filed under another block");
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
    if (n.hash != content_hash(n.parent->hash, n.precision, n.keys, n.roles)) fail(at + "has a stale hash");
    const auto h = by_hash_.find(n.hash);
    if (h == by_hash_.end() || h->second != &n) fail(at + "is not found by its hash");
    // Reachable: the parent chain ends at this layer's root.
    const PrefixNode* up = &n;
    for (std::size_t steps = 0; up->parent != nullptr && steps <= by_block_.size(); ++steps) up = up->parent;
    if (up != &roots_[static_cast<std::size_t>(n.layer)]) fail(at + "is not reachable from its layer's root");
    const std::int32_t refs = pool(n.precision).ref_count(n.block);
    if (refs < 1) fail(at + "is free in its pool");
    if (n.hook.is_linked() != (refs == 1)) {
      fail(at + "has " + std::to_string(refs) + " holders but is " + (n.hook.is_linked() ? "" : "not ") +
           "on the LRU list (only blocks no sequence holds are)");
    }
    if (n.hook.is_linked()) {
      ++linked;
      ++evictable[static_cast<std::size_t>(pool_index(n.precision))];
    }
  }
  std::size_t walked = 0;
  for (const PrefixNode& n : lru_) {
    if (node_of(n.precision, n.block) != &n) fail("prefix index: the LRU list holds a node the index does not");
    if (++walked > by_block_.size()) fail("prefix index: the LRU list is longer than the index");
  }
  if (walked != linked || evictable != evictable_) {
    fail("prefix index: " + std::to_string(walked) + " nodes on the LRU list, " + std::to_string(linked) +
         " linked, counts per pool " + std::to_string(evictable_[0]) + "/" + std::to_string(evictable_[1]) + "/" +
         std::to_string(evictable_[2]) + " recorded");
  }
}

void PrefixIndex::describe(std::string& out) const {
  auto put = [&out](const char* label, std::int64_t value) {
    out += label;
    out += std::to_string(value);
  };
  put("prefix index: blocks ", static_cast<std::int64_t>(by_block_.size()));
  out += "\n";
  // Depth first, children in the order they were indexed.
  std::vector<const PrefixNode*> stack;
  for (const PrefixNode& root : roots_) {
    for (auto it = root.children.rbegin(); it != root.children.rend(); ++it) stack.push_back(*it);
    while (!stack.empty()) {
      const PrefixNode& n = *stack.back();
      stack.pop_back();
      put("  layer ", n.layer);
      out += ' ';
      out += to_string(n.precision);
      put(" block ", n.block);
      put(" after ", n.parent->block);
      put(" rows ", n.begin);
      put("-", n.end);
      out += " hash ";
      out += std::to_string(n.hash);
      put(" refs ", pool(n.precision).ref_count(n.block));
      out += "\n";
      for (auto it = n.children.rbegin(); it != n.children.rend(); ++it) stack.push_back(*it);
    }
  }
  out += "  lru:";
  for (const PrefixNode& n : lru_) {
    out += ' ';
    out += to_string(n.precision);
    put(":", n.block);
  }
  out += "\n";
}

}  // namespace mixkv::detail
