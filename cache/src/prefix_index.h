#pragma once
// The prefix index of KVCacheManager (private header: cache/src only, and
// the tests' corruption hook). Per layer a tree of full prompt blocks in the
// order they complete along the prompt; a node names the rows since its
// parent's end with their content keys and roles, so the path from the root
// fixes every row up to the node's end, and with it what its block holds.
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <boost/intrusive/list.hpp>
#include <boost/unordered/unordered_flat_map.hpp>

#include "mixkv/cache/block_pool.h"
#include "mixkv/cache/kv_cache_manager.h"

namespace mixkv::detail {

// A row's role in its layer: bit 0 its kind (visual), bits 1-2 its window's
// class: 0 outside a full window; inside one, 1 + pool_index under
// precision identity and 1 under content identity (a window's node holds
// its copies at every precision). Two rows with equal keys and roles are
// stored alike.
using RowRole = std::uint8_t;
inline RowRole row_role(TokenKind kind, int window_class) {
  return static_cast<RowRole>((kind == TokenKind::Visual ? 1 : 0) | (window_class << 1));
}
inline int window_class(RowRole role) { return role >> 1; }

struct PrefixNode;

// A node's block at one precision; block -1 where it has none.
struct PrefixCopy {
  using Hook = boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::safe_link>>;
  PrefixNode* node = nullptr;
  Precision precision = Precision::FP16;
  std::int32_t block = -1;
  Hook hook;  // on the LRU list iff the index alone holds the block
};

struct PrefixNode {
  PrefixNode();
  PrefixNode(const PrefixNode&) = delete;
  PrefixNode& operator=(const PrefixNode&) = delete;

  PrefixNode* parent = nullptr;  // null for a layer's root
  std::vector<PrefixNode*> children;
  std::uint64_t hash = 0;  // of (parent's hash, identity tag, keys, roles); a root's: the seed
  std::int32_t layer = 0;
  std::int32_t begin = 0;  // rows [begin, end): since the parent's end, up to this block's last row
  std::int32_t end = 0;
  std::vector<TokenKey> keys;  // [end - begin]
  std::vector<RowRole> roles;  // [end - begin]
  // [pool_index]: one copy under precision identity (the precision its
  // roles name), one or more under content identity; none for a root.
  std::array<PrefixCopy, kNumPrecisions> copies;

  bool has(Precision p) const { return copies[static_cast<std::size_t>(pool_index(p))].block >= 0; }
  std::int32_t block(Precision p) const { return copies[static_cast<std::size_t>(pool_index(p))].block; }
  int num_copies() const;
};

// Owns the nodes, holds one reference on each copy's block and keeps the
// copies no sequence holds on an LRU list (evicted from the front), counted
// per pool. Nothing but make() and reserve() allocates, so the manager's
// commit phases may retain, release and evict.
class PrefixIndex {
 public:
  PrefixIndex(std::int32_t num_layers, std::array<BlockPool*, kNumPrecisions> pools, PrefixIdentity identity);
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  PrefixIdentity identity() const { return identity_; }
  bool content() const { return identity_ == PrefixIdentity::Content; }
  // Of (parent, tag, keys, roles); the tag is the precision's pool index
  // under precision identity and kNumPrecisions under content identity.
  static std::uint64_t content_hash(std::uint64_t parent, int tag, std::span<const TokenKey> keys,
                                    std::span<const RowRole> roles);
  int tag(Precision p) const { return content() ? kNumPrecisions : pool_index(p); }

  const PrefixNode& root(std::int32_t layer) const { return roots_[static_cast<std::size_t>(layer)]; }
  PrefixNode& root(std::int32_t layer) { return roots_[static_cast<std::size_t>(layer)]; }
  // The child of `parent` with exactly this content (verified), or null;
  // under precision identity, the one holding `p`. `hash` is the content's,
  // content_hash(parent.hash, tag(p), keys, roles): a node's hash does not
  // depend on its layer (every root has the same), so layers that walk the
  // same rows under the same roles hash them once.
  const PrefixNode* find(const PrefixNode& parent, Precision p, std::uint64_t hash, std::span<const TokenKey> keys,
                         std::span<const RowRole> roles) const;
  // Whether a node of `layer` has this hash (another content's, when find() says none).
  bool hash_taken(std::int32_t layer, std::uint64_t hash) const { return by_hash_.contains(node_key(layer, hash)); }
  const PrefixNode* node_of(Precision p, std::int32_t block) const;
  std::size_t size() const { return by_block_.size(); }  // copies

  // Inserting is split like the manager's calls: make() builds a node that
  // belongs to nothing yet (may throw std::bad_alloc), reserve() makes room
  // for `nodes` more nodes and `copies` more copies (theirs included), and
  // link() and add_copy() take them in, retaining the block, without
  // allocating. `parent` is a linked node or a node made for the same call.
  // `hash` is content_hash(parent.hash, tag(p), keys, roles).
  std::unique_ptr<PrefixNode> make(PrefixNode& parent, Precision p, std::int32_t block, std::int32_t begin,
                                   std::uint64_t hash, std::span<const TokenKey> keys,
                                   std::span<const RowRole> roles) const;
  void reserve(std::size_t nodes, std::size_t copies);
  void link(std::unique_ptr<PrefixNode> node);
  // Content identity: `block` becomes the node's copy at `p` (it has none).
  void add_copy(const PrefixNode& node, Precision p, std::int32_t block);

  // After a sequence retained or released an indexed block: whether it is
  // held by the index alone decides its place on the LRU list.
  void holders_changed(Precision p, std::int32_t block);

  BlockCounts evictable() const { return evictable_; }
  std::int64_t evictable_total() const { return evictable_[0] + evictable_[1] + evictable_[2]; }
  // Each block on the LRU list, front first.
  template <class F>
  void for_each_evictable(F&& f) const {
    for (const PrefixCopy& c : lru_) f(c.precision, c.block);
  }
  BlockCounts cached() const;
  BlockCounts evicted() const { return evicted_; }

  // Evicts the least recently released copy; a node left without copies
  // goes with its subtree (unreachable without it): blocks no sequence
  // holds are freed, the others left to their holders. Allocates nothing.
  // False when nothing is evictable.
  bool evict_one();

  // InvariantViolation for the first broken rule of the index itself (tree,
  // hashes, maps, LRU list, counts); the manager checks the ref counts.
  void check() const;
  void describe(std::string& out) const;
  // Each indexed (pool, block) once, for the manager's ref-count check.
  template <class F>
  void for_each_block(F&& f) const {
    for (const auto& [key, copy] : by_block_) f(copy->precision, copy->block);
  }

 private:
  friend struct ManagerTestAccess;
  using Lru = boost::intrusive::list<PrefixCopy,
                                     boost::intrusive::member_hook<PrefixCopy, PrefixCopy::Hook, &PrefixCopy::hook>>;
  // The maps' key of a node: its hash, told apart by its layer.
  static std::uint64_t node_key(std::int32_t layer, std::uint64_t hash);
  static std::int64_t block_key(Precision p, std::int32_t block) {
    return (std::int64_t{pool_index(p)} << 32) | static_cast<std::uint32_t>(block);
  }
  BlockPool& pool(Precision p) const { return *pools_[static_cast<std::size_t>(pool_index(p))]; }
  void set_evictable(PrefixCopy& copy, bool evictable);
  void take_copy(PrefixCopy& copy, std::int32_t block);
  // Drops the index's reference on the copy's block and forgets it.
  void remove_copy(PrefixCopy& copy);
  // Unlinks `node` (no children left) and its copies from every structure.
  void remove_leaf(PrefixNode& node);

  std::array<BlockPool*, kNumPrecisions> pools_;
  PrefixIdentity identity_;
  std::vector<PrefixNode> roots_;                                                  // [layer]
  boost::unordered_flat_map<std::uint64_t, std::unique_ptr<PrefixNode>> by_hash_;  // node_key -> node
  boost::unordered_flat_map<std::int64_t, PrefixCopy*> by_block_;
  Lru lru_;  // front: released longest ago
  BlockCounts evictable_{};
  BlockCounts evicted_{};
};

}  // namespace mixkv::detail
