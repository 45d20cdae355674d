#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/scheduler/request.h"

namespace mixkv {

// One prefill chunk: prompt rows [start, end) of a request. The prompt of a
// request preempted by recompute is its original prompt plus the tokens it
// had generated (as text).
struct PrefillChunk {
  RequestId id = 0;
  std::int32_t slot = 0;   // the request's page-table slot (see StepOutput)
  std::int32_t start = 0;  // first prompt row computed in this step
  std::int32_t end = 0;    // one past the last; never inside a visual window
  bool last = false;       // completes the prompt: the engine samples a token
  // [layer]: where rows [start, end) go; row r of the chunk is mapping row
  // r - start (store_prefill of the chunk's K/V). Concatenate chunks with
  // StoreMapping::append.
  std::vector<StoreMapping> mappings;
};

struct FinishedRequest {
  RequestId id = 0;
  FinishReason reason = FinishReason::Length;
  std::int32_t generated = 0;  // tokens generated
  // Empty, unless the scheduler ended the request itself: Cancelled because
  // its sequence vanished from the cache (scheduler.h), e.g. "request 7's
  // sequence left the cache outside the scheduler ...".
  std::string note;
};

struct RejectedRequest {
  RequestId id = 0;
  std::string reason;  // e.g. "needs 1,204 INT4 blocks, the whole cache holds 990"
};

// What the engine does in one step, in this order (the order in which the
// scheduler made the changes, so no copy reads memory that an earlier one
// reused):
//   1. demotions (cpu::demote / gpu::demote; any order within the step),
//   2. swap_out copies (device -> host),
//   3. swap_in copies (host -> device),
//   4. append.copies (copy-on-write of shared FP16 tails),
//   5. the forward pass: prefill chunks (store_prefill through their
//      mappings) and the decode batch (append K/V at append.slots, then
//      decode attention over the metadata).
struct StepOutput {
  std::int64_t step = 0;

  std::vector<PrefillChunk> prefills;
  // The decode batch, in batch order, and each request's page-table slot.
  std::vector<RequestId> decodes;
  std::vector<std::int32_t> decode_slots;
  // append.slots[layer][i]: FP16 slot of decodes[i]'s new token
  // (SchedulerConfig::per_layer_slots), always in compact form too:
  // slots[layer][i] == tail(decode_slots[i], layer) * block_size +
  // append.offsets[i], where an engine keeps each slot's per-layer FP16 tail
  // blocks: read from the page table for tables_changed, replaced by
  // append.tail_blocks for the decodes listed in append.tails_changed.
  AppendResult append;
  // Speculative decoding (SchedulerConfig::num_speculative_tokens,
  // Scheduler::speculate): empty when no decode of the step has drafts,
  // the plain step above. Otherwise [decodes.size() + 1] row offsets
  // (FlashInfer's qo_indptr): decodes[i] has the query rows
  // decode_rows[i] .. decode_rows[i + 1] - 1, its last sampled token first,
  // then its drafts (decode_rows[i + 1] - decode_rows[i] - 1 of them), all
  // stored this step: append.slots[layer][r] is row r's FP16 slot
  // (KVCacheManager::append_tokens with counts), append.offsets[i] the
  // offset of decodes[i]'s first row. The metadata covers every row's token
  // too (the cache after the append), as in a plain step; an attention that
  // takes the new rows from k/v (causal among them) reads each decode's
  // FP16 pages without its last decode_rows[i + 1] - decode_rows[i] tokens.
  // After verification the engine calls Scheduler::accept for each decode
  // with drafts.
  std::vector<std::int32_t> decode_rows;

  std::vector<DemoteOp> demotions;
  // demotions[0, plan_demotions) apply the plans of prompts prefilled FP16
  // (PrefillMode::Exact), the rest relieve memory pressure; one manager
  // call made them all, so any order still holds.
  std::int32_t plan_demotions = 0;
  // demotions[plan_demotions, plan_demotions + age_demotions) demote windows
  // that aged past the recent ones (SchedulerConfig::age_tiers); a demoted
  // stream block k of a request appears as window plan.num_windows() + k.
  std::int32_t age_demotions = 0;
  std::vector<SwapCopy> swap_out;
  std::vector<SwapCopy> swap_in;
  std::vector<RequestId> swapped_out;  // requests whose blocks swap_out moves
  std::vector<RequestId> swapped_in;
  std::vector<RequestId> preempted;  // preempted by recompute (blocks freed)

  // Requests whose page lists changed this step other than by appending
  // (admitted, swapped in, demoted), and those forked since the previous
  // step that still hold device memory: an engine that mirrors page tables
  // per slot (gpu::DevicePageTables::sync) refreshes these; appends it can
  // apply from append.slots.
  std::vector<RequestId> tables_changed;

  // Requests that left the scheduler since the previous step: finished
  // (their last token came out of the previous step, or finish()/cancel()
  // was called) and rejected (never fit).
  std::vector<FinishedRequest> finished;
  std::vector<RejectedRequest> rejected;

  std::int32_t num_batched_tokens = 0;  // decode rows (drafts included) + prefill chunk rows

  // Decode attention metadata of `decodes` for every layer and pool, CSR
  // (SchedulerConfig::build_metadata; empty layers otherwise).
  DecodeMetadata metadata;
};

}  // namespace mixkv
