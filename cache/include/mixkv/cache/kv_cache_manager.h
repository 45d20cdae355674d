#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mixkv/core/block_format.h"
#include "mixkv/core/cache_shape.h"
#include "mixkv/core/op_types.h"
#include "mixkv/core/page_table.h"
#include "mixkv/core/pool_view.h"
#include "mixkv/core/precision.h"
#include "mixkv/core/precision_plan.h"
#include "mixkv/core/token_layout.h"

namespace mixkv {

namespace detail {
struct ManagerTestAccess;
}  // namespace detail

// Prefix caching (docs/architecture.md, "Prefix index"): full prompt
// blocks outlive their sequence in an index keyed by their content, and a
// later prompt with the same prefix shares them instead of recomputing.
// What names a cached block besides its rows' keys.
enum class PrefixIdentity : std::uint8_t {
  // The precision of every window up to its end, its own included: rows
  // computed reading quantized windows (PrefillMode::Compact) hold other
  // K/V behind other plans, so a block is shared only behind the same ones.
  Precision = 0,
  // Nothing else: every row's K/V is computed reading FP16 keys
  // (PrefillMode::Exact), so it depends on the tokens alone. A window's
  // node keeps copies at one or more precisions, and a plan takes the copy
  // it wants, or reads the FP16 copy and demotes to its own.
  Content = 1,
};

// Content identity: a window a plan wants below the FP16 copy the cache
// holds (and holds at no lower copy the plan wants).
enum class PrefixHigher : std::uint8_t {
  // Shared FP16 while the prompt is prefilled (its rows read FP16 keys),
  // then demoted to the plan's precision in a block of the sequence's own:
  // each request decodes at its own plan, bytes and accuracy.
  Demote = 0,
  // Kept at FP16 for decoding too: more bytes, no demotion.
  Keep = 1,
};

struct PrefixCacheConfig {
  bool enabled = false;
  // A window the cache holds at a higher precision than a plan wants is
  // shared at the cached precision (more bytes, better accuracy); false:
  // the match ends there and the window is recomputed. A lower cached
  // precision is never shared. Under content identity this covers copies
  // above the plan's precision other than an FP16 one (see `higher`).
  bool share_higher = true;
  PrefixIdentity identity = PrefixIdentity::Precision;
  PrefixHigher higher = PrefixHigher::Demote;
};

struct CacheConfig {
  CacheShape shape;
  std::size_t arena_bytes = 0;        // total KV memory, all pools together
  std::size_t slab_bytes = 2u << 20;  // unit in which memory moves between pools
  // Host swap pool: slots per pool for swapped-out blocks (swap_out/swap_in);
  // all 0 = no swapping. Bookkeeping only: the host buffer is the caller's
  // (pinned host memory with the GPU backend), swap_bytes() long.
  BlockCounts swap_blocks{};
  // Order in which a layer's FP16 tokens are packed. false: prompt order
  // (text, FP16 windows, visual tails as they come). true: the FP16 visual
  // windows first, each in a whole block of its own, then every other FP16
  // token in prompt order. Decode attention ignores key order, so both give
  // the same results; with true every FP16 window can be demoted (demote()),
  // with false only the windows whose tokens happen to fill one block.
  bool fp16_windows_first = false;
  PrefixCacheConfig prefix_cache{};
};

// What identifies one prompt token's content for prefix caching: the token
// id of a text token, a 64-bit hash of a visual token's embedding (the
// engine's). Two prompts share a block only where these and the layout
// agree on every row up to the block's end.
using TokenKey = std::uint64_t;

// A prompt held against the prefix index (match_prefix, add_sequence).
struct PrefixMatch {
  // Prompt rows [0, rows) are held by cached blocks: a window boundary
  // where, in every layer, no block holds rows on both sides; below the
  // prompt's length (its last row is always computed: it samples the first
  // token).
  std::int32_t rows = 0;
  // The plan the sequence is stored at: the given one, except windows below
  // `rows` shared at a higher precision (PrefixCacheConfig::share_higher).
  PrecisionPlan plan;
  BlockCounts shared{};  // cached blocks it shares, per pool
  BlockCounts demand{};  // blocks to allocate besides them (demand(layout, plan) - shared)
  // Of `shared`, blocks only the index holds now: they count as free until
  // shared (can_allocate(blocks, match) takes them out). The manager's ids.
  BlockCounts revived{};
  std::array<std::vector<std::int32_t>, kNumPrecisions> revived_ids;
};

struct PrefixCacheStats {
  BlockCounts cached{};        // blocks the index holds
  BlockCounts evictable{};     // of them, held by no sequence (they count as free)
  std::int64_t published = 0;  // blocks indexed (publish_prefix), in total
  std::int64_t hits = 0;       // add_sequence calls that shared a block
  std::int64_t hit_rows = 0;   // prompt rows those calls found cached
  BlockCounts shared{};        // blocks they shared, per pool
  BlockCounts evicted{};       // blocks evicted (freed or left to their holders)
};

struct PoolStats {
  std::size_t block_bytes = 0;
  std::int32_t blocks_per_slab = 0;
  std::int32_t slabs = 0;        // slabs this pool holds now
  std::int64_t used_blocks = 0;  // blocks owned by at least one page table
  std::int64_t free_blocks = 0;  // free blocks inside this pool's slabs
  std::int32_t empty_slabs = 0;  // slabs with no used block (other pools may reclaim them)
};

// One window of one layer to move to a lower precision (demote()).
struct Demotion {
  SequenceId id = 0;
  std::int32_t layer = 0;
  std::int32_t window = 0;  // 1 .. num_windows - 1 (window 0 always stays FP16)
  Precision target = Precision::INT4;
  // Age tiers: `window` names the window-th full block of the sequence's
  // FP16 stream instead of a visual window. The stream is every token
  // outside visual windows (text, visual tails, generated tokens) in order,
  // so its block k holds stream tokens [k * block_size, (k + 1) *
  // block_size) in every layer; 0 .. stream_blocks(id) - 1. Its DemoteOp
  // names it as window plan(id).num_windows() + k.
  bool stream = false;
  // false: the window's block must be this sequence's alone (besides the
  // prefix index), so that the demotion frees it. true: other sequences
  // may share it; this one moves to a copy of its own and they keep the
  // original (a plan applied to windows shared from the prefix cache).
  bool leave_shared = false;
};

// Names a sequence without a look-up by id, for callers that append every
// step (a scheduler): valid from add_sequence/fork until free_sequence (swap
// out and in keep it); a stale handle is an UnknownId, never a wrong sequence.
struct SequenceHandle {
  std::int32_t index = -1;
  std::uint32_t generation = 0;
  friend bool operator==(const SequenceHandle&, const SequenceHandle&) = default;
};

// What append_tokens() returns for the slots of the new tokens.
enum class AppendSlots : std::uint8_t {
  // AppendResult::slots, [layer][i] (num_layers x batch entries), and the
  // compact form.
  PerLayer = 0,
  // The compact form only: O(batch) outside block boundaries.
  Compact = 1,
};

struct AppendResult {
  // [layer][i]: FP16 slot of sequence i's new token in that layer
  // (AppendSlots::PerLayer; empty with AppendSlots::Compact).
  std::vector<std::vector<std::int32_t>> slots;
  // Copy-on-write of shared, partly filled FP16 tail blocks: the caller
  // copies these (ops::copy_blocks) before writing the new tokens.
  std::vector<BlockCopy> copies;

  // The compact form of the slots (always filled):
  //   slots[layer][i] == tail(i, layer) * block_size + offsets[i],
  // tail(i, layer) being the layer's FP16 tail block after the call
  // (PageTable::fp16_tails()). A layer's FP16 tokens are densely packed
  // and its quantized blocks hold whole windows, so the new token has the
  // same offset in every layer; 0 means a new tail block. An engine keeps
  // the tails per sequence and updates them from tails_changed.
  std::vector<std::int32_t> offsets;  // [i]
  // Sequences (batch indices, ascending) whose tail block changed in some
  // layer in this call (a new block, or a copy-on-write copy), and their
  // tails after it: tail_blocks[k * num_layers + layer] for tails_changed[k].
  std::vector<std::int32_t> tails_changed;
  std::vector<std::int32_t> tail_blocks;
};

// Owns the bookkeeping of the KV cache: the arena's slabs, the three pools,
// every sequence's page tables. It never touches KV bytes: the ops (CPU
// reference or CUDA) read and write blocks through pool_view(), so one
// manager serves the host and the device backend alike.
//
// Every public call validates its input and throws a typed error naming the
// argument (errors.h); a call that throws leaves the manager unchanged.
class KVCacheManager {
 public:
  explicit KVCacheManager(CacheConfig config);
  ~KVCacheManager();
  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  const CacheConfig& config() const;
  BlockFormat format(Precision p) const;
  // The three pools inside the arena (arena_layout().at(base)[p]).
  PoolView pool_view(Precision p, std::byte* arena_base) const;
  // The arena's pools without an address: what a backend allocating the
  // arena (gpu::DeviceArena) needs to address and bound-check block ids.
  PoolLayout arena_layout() const;
  PoolStats pool_stats(Precision p) const;
  std::int32_t total_slabs() const;
  std::int32_t free_slabs() const;
  // Used blocks of pool p in arena slab `slab` (0 when p does not own it):
  // how many releases would give the slab back. IndexOutOfRange names "slab".
  std::int32_t used_in_slab(Precision p, std::int32_t slab) const;

  // Blocks a prompt needs per pool, over all layers.
  BlockCounts demand(const TokenLayout& layout, const PrecisionPlan& plan) const;
  // Whether `blocks` more blocks per pool could be allocated now, counting
  // free slabs and empty slabs other pools could give back, and the blocks
  // (and slabs) that evicting the prefix index's unheld blocks would free:
  // every allocating call evicts them, least recently released first,
  // before it reports OutOfMemory.
  bool can_allocate(const BlockCounts& blocks) const;
  // The same after `match`'s shared blocks are taken (those only the index
  // holds stop counting as free): whether add_sequence with the match's
  // arguments and `blocks` = match.demand (plus any reserve) succeeds. The
  // match must be this manager's, made since its last change.
  bool can_allocate(const BlockCounts& blocks, const PrefixMatch& match) const;

  // Registers a sequence and allocates the blocks of its whole prompt under
  // `plan` (plan.num_layers() == num_layers, plan.num_windows() ==
  // layout.num_windows(block_size)). OutOfMemory leaves nothing allocated.
  void add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan);

  // --- Prefix caching (CacheConfig::prefix_cache) ---
  // The longest prefix of the prompt the index can serve: keys[r] is row
  // r's content key (keys.size() <= layout.num_tokens(); rows past the keys
  // never match). A block is shared only where it holds exactly the rows the
  // prompt has there, with the same keys, layout and precision in its layer,
  // verified key by key (a hash collision never shares); the first
  // difference in any layer ends the match. rows 0 (shared nothing) when
  // prefix caching is off or keys is empty. Errors as add_sequence's, and
  // InvalidArgument naming keys.
  //
  // Under PrefixIdentity::Content the precision is no part of a block's
  // name: a window's node holds copies, and `wanted` (the plan the request
  // will decode at; `plan` itself in the three-argument form) chooses, for
  // each window below the match, among them: the FP16 copy where `plan`
  // stores the window FP16 and PrefixHigher::Demote (the caller demotes it
  // to `wanted` after the prefill), else the copy `wanted` names, else under
  // PrefixHigher::Keep the FP16 copy, else with share_higher the lowest copy
  // above it; a window with none of these ends the match. match.plan holds
  // each shared window at the copy taken, the rest at `plan`.
  PrefixMatch match_prefix(const TokenLayout& layout, const PrecisionPlan& plan, std::span<const TokenKey> keys) const;
  PrefixMatch match_prefix(const TokenLayout& layout, const PrecisionPlan& plan, std::span<const TokenKey> keys,
                           const PrecisionPlan& wanted) const;
  // add_sequence sharing the blocks of match_prefix(layout, plan, keys)
  // (returned; the sequence is stored at its plan, and rows [0, rows) are
  // not to be stored again: prefill starts at `rows`). OutOfMemory when
  // match.demand cannot be had; all or nothing.
  PrefixMatch add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan,
                           std::span<const TokenKey> keys);
  PrefixMatch add_sequence(SequenceId id, const TokenLayout& layout, const PrecisionPlan& plan,
                           std::span<const TokenKey> keys, const PrecisionPlan& wanted);
  // Indexes the full blocks of `id` that hold only prompt rows [0,
  // keys.size()), which the caller has stored (computed) and whose content
  // keys are `keys`: from now on they outlive the sequence and later
  // prompts share them. A block whose content is cached already (another
  // sequence's) or whose hash is taken is not indexed, and ends its layer's
  // chain. Returns the blocks newly indexed (0 with prefix caching off).
  // UnknownId naming id; InvalidArgument for a swapped-out id or naming keys
  // (longer than the prompt). Indexed blocks are never written again.
  // Under PrefixIdentity::Content a block whose content is cached adds its
  // precision's copy to the node when it has none, and the caller states
  // that every row it publishes was computed reading FP16 keys; rows after
  // a hit that shared a window below FP16 are not published.
  std::int64_t publish_prefix(SequenceId id, std::span<const TokenKey> keys);
  // Evicts every indexed block no sequence holds; returns how many.
  std::int64_t evict_prefix_cache();
  PrefixCacheStats prefix_stats() const;
  bool contains(SequenceId id) const;
  std::vector<SequenceId> sequence_ids() const;  // ascending
  std::int32_t num_tokens(SequenceId id) const;  // prompt + appended
  const TokenLayout& layout(SequenceId id) const;
  const PrecisionPlan& plan(SequenceId id) const;

  // Where the prompt rows of `id` go in `layer`.
  StoreMapping prefill_mapping(SequenceId id, std::int32_t layer) const;

  // One decode token for each sequence (distinct ids), FP16 in every layer.
  // All or nothing: OutOfMemory leaves every sequence as it was. A
  // sequence outside forks whose token count is not a multiple of
  // block_size costs O(1) with AppendSlots::Compact (every layer's tail
  // has room); the others O(num_layers).
  AppendResult append_tokens(std::span<const SequenceId> ids, AppendSlots form = AppendSlots::PerLayer);
  // The same through handles (UnknownId names handles[i] when stale).
  AppendResult append_tokens(std::span<const SequenceHandle> handles, AppendSlots form = AppendSlots::PerLayer);
  SequenceHandle handle(SequenceId id) const;

  // --- Speculative decoding: several tokens per sequence, then truncation ---
  // counts[i] >= 1 decode tokens for sequence i (distinct ids, FP16 in every
  // layer; counts.size() == ids.size(), else InvalidArgument naming counts).
  // All or nothing: OutOfMemory leaves every sequence as it was. Layout:
  // sequence i's tokens are consecutive, in order, from row r_i = counts[0]
  // + ... + counts[i - 1] (FlashInfer's qo_indptr), so
  //   slots[layer][r_i + j]  (AppendSlots::PerLayer; sum(counts) a layer)
  // is the FP16 slot of its j-th new token. offsets[i] is the offset of its
  // first token in its block (the same in every layer, 0 for a new block);
  // copies, tails_changed and tail_blocks are as above (tails after the
  // call). A token past the first block boundary sits in a block that no
  // tail names: with AppendSlots::Compact, read it from the page table
  // (page_table(id).fp16_slot(layer, fp16_tokens(layer) - counts[i] + j)).
  // With every count 1 the result equals the one-token call's.
  AppendResult append_tokens(std::span<const SequenceId> ids, std::span<const std::int32_t> counts,
                             AppendSlots form = AppendSlots::PerLayer);
  AppendResult append_tokens(std::span<const SequenceHandle> handles, std::span<const std::int32_t> counts,
                             AppendSlots form = AppendSlots::PerLayer);
  // Drops the last tokens of `id` so that it holds num_tokens: the rejected
  // drafts of a verification step. Only appended tokens can go:
  // InvalidArgument naming num_tokens below the prompt length
  // (layout(id).num_tokens()) or above num_tokens(id); UnknownId naming id;
  // InvalidArgument for a swapped-out id. Every layer's FP16 blocks left
  // empty are released (a block shared after a fork only loses this
  // holder); a partly filled tail that is still shared is copied on the next
  // append (copy-on-write, as after fork()). Blocks are released in the
  // reverse of the order append_tokens took them, so appending and then
  // truncating back restores describe_state() exactly, unless the append
  // took a slab (released blocks stay in their pool, which keeps the empty
  // slab until another pool needs it) or copied a shared tail (the private
  // copy stays: the original may since have been rewritten by its other
  // holders, so the sequence cannot share it again).
  void truncate(SequenceId id, std::int32_t num_tokens);
  // The same for several sequences at once, all or nothing (errors name
  // ids[i] or num_tokens[i]): releasing in the reverse of one append_tokens
  // call's order restores the free lists after a batch append too.
  void truncate(std::span<const SequenceId> ids, std::span<const std::int32_t> num_tokens);

  // `child` shares every block of `parent` (ref counts); the partly filled
  // FP16 tail is copied on the first append to either.
  void fork(SequenceId parent, SequenceId child);
  void free_sequence(SequenceId id);

  // Block ids of (sequence, layer, pool) in order, and the FP16 tail's fill.
  std::span<const std::int32_t> blocks(SequenceId id, std::int32_t layer, Precision p) const;
  // The block that holds visual window `window` of `layer`, in the pool of
  // the window's precision (plan(id).at(layer, window)); -1 for an FP16
  // window whose tokens share blocks with other tokens (see
  // why_not_demotable). IndexOutOfRange names "layer" or "window".
  std::int32_t window_block(SequenceId id, std::int32_t layer, std::int32_t window) const;
  std::int32_t fp16_tail_fill(SequenceId id, std::int32_t layer) const;
  // Holders of a block: the page tables that hold it, plus one while the
  // prefix index holds it.
  std::int32_t ref_count(Precision p, std::int32_t block_id) const;

  DecodeMetadata decode_metadata(std::span<const SequenceId> ids) const;

  // The page lists of a sequence that is not swapped out. The reference
  // stays valid (and shows every later change) until the sequence is freed
  // or swapped out: what incremental metadata builders hold on to.
  const PageTable& page_table(SequenceId id) const;
  // Blocks the sequence holds per pool (host slots while swapped out).
  BlockCounts blocks_held(SequenceId id) const;

  // --- Host swap pool (CacheConfig::swap_blocks) ---
  BlockCounts free_swap_slots() const;
  // Bytes of the caller's host swap buffer: the three pools' slots, FP16
  // first, then INT4, then INT2.
  std::size_t swap_bytes() const;
  // Addresses host slots of pool p inside that buffer (host_base = its
  // first byte): block(slot) = the slot's block_bytes.
  PoolView swap_view(Precision p, std::byte* host_base) const;
  // The swap buffer's pools without an address (swap_layout().at(base)[p]).
  PoolLayout swap_layout() const;
  bool is_swapped(SequenceId id) const;
  // Moves every block of `id` to the host swap pool: returns the copies to
  // make (device -> host) before the released device blocks are reused.
  // Shared blocks stay on the device for their other holders; the swapped
  // sequence gets a private copy of each. OutOfMemory when the host pool
  // lacks slots; InvalidArgument when `id` is swapped out already.
  std::vector<SwapCopy> swap_out(SequenceId id);
  // Brings `id` back into fresh device blocks: returns the copies to make
  // (host -> device) before the sequence is used. All or nothing:
  // OutOfMemory when the device pools lack blocks (can_allocate(
  // blocks_held(id)) says so beforehand); InvalidArgument unless swapped.
  std::vector<SwapCopy> swap_in(SequenceId id);

  // --- Demotion (memory pressure) ---
  // Whether (id, layer, window) could move one precision down now, ignoring
  // memory: window >= 1, not INT2 yet, its block held by this sequence only
  // (and perhaps the prefix index, which keeps the original), and for an
  // FP16 window its tokens filling exactly one FP16 block
  // (always so with fp16_windows_first). Returns the reason when not.
  // leave_shared: as Demotion::leave_shared, other sequences may share it.
  std::optional<std::string> why_not_demotable(SequenceId id, std::int32_t layer, std::int32_t window, Precision target,
                                               bool leave_shared = false) const;
  // Demotes every listed window: takes a target-pool block for each, moves
  // the window to it in the page table and the plan (so demand, mappings
  // and metadata stay consistent) and releases the source block. All or
  // nothing: InvalidArgument (naming demotions[i]) for a window that
  // why_not_demotable() refuses or that is listed twice, OutOfMemory when
  // the target pools lack blocks. Returns one DemoteOp per demotion, in order.
  std::vector<DemoteOp> demote(std::span<const Demotion> demotions);

  // --- Age tiers: full blocks of the FP16 stream (Demotion::stream) ---
  // Full blocks of the stream: (num_tokens(id) - visual window tokens) /
  // block_size. The stream is the layer's FP16 list after its FP16 windows
  // with fp16_windows_first; in prompt order only in a layer without FP16
  // windows (elsewhere the windows sit inside it, and why_not says so).
  std::int32_t stream_blocks(SequenceId id) const;
  // Precision of stream block `block` of `layer` (FP16 until demoted).
  // IndexOutOfRange names "layer" or "block".
  Precision stream_precision(SequenceId id, std::int32_t layer, std::int32_t block) const;
  // Stream blocks of (id, layer) held in pool p below FP16 (0 for FP16).
  std::int64_t aged_blocks(SequenceId id, std::int32_t layer, Precision p) const;
  // Whether (id, layer, stream block) could move to `target` now, ignoring
  // memory: target below its precision, the block held by this sequence
  // only (and perhaps the prefix index, which keeps the original), and the
  // layer's stream made of whole blocks (see stream_blocks). The reason
  // when not. A sequence with a demoted stream block has stored its prompt:
  // prefill_mapping and publish_prefix refuse it (InvalidArgument), and
  // truncate never drops its tokens.
  std::optional<std::string> why_not_stream_demotable(SequenceId id, std::int32_t layer, std::int32_t block,
                                                      Precision target) const;

  // Throws InvariantViolation describing the first broken invariant.
  void check_invariants() const;
  // Canonical text of all bookkeeping (slabs, free lists in order, ref
  // counts, page tables, the prefix index): equal texts mean equal states.
  std::string describe_state() const;

 private:
  // Tests corrupt the bookkeeping through it to see check_invariants() fire.
  friend struct detail::ManagerTestAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixkv
