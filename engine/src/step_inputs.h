#pragma once
// What both backends take from a StepOutput for the forward pass, checked
// against the manager and flattened once in apply(): the prefill mapping of
// every layer (chunks concatenated) and the decode slots of every layer.
#include <cstdint>
#include <span>
#include <vector>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/tensor_view.h"
#include "mixkv/engine/backend.h"
#include "mixkv/scheduler/step_output.h"

namespace mixkv::engine_detail {

struct StepInputs {
  bool applied = false;   // a step has been applied (store/attend refuse before)
  std::int32_t rows = 0;  // prefill rows of the step, chunks concatenated
  std::int32_t batch = 0;
  // Query rows of the decode batch: batch, or with drafts (speculative
  // decoding) decode_rows.back(); decode_rows empty without drafts.
  std::int32_t decode_rows = 0;
  std::vector<std::int32_t> decode_indptr;  // [batch + 1] with drafts, else empty
  std::vector<StoreMapping> mappings;       // [layer]
  std::vector<std::int32_t> slots;          // [layer * decode_rows + r]: FP16 slot of decode row r's token
  // The prefill chunks for extend attention (prefill()): each chunk's
  // sequence, its first row, and the chunks' rows as CSR offsets.
  std::vector<SequenceId> chunk_ids;
  std::vector<std::int32_t> chunk_starts;
  std::vector<std::int32_t> qo_indptr;  // [chunks + 1]
};

// Validates `config` as both backends need it (InvalidArgument naming the
// field): the cache config is checked by the manager.
void check_config(const char* fn, const BackendConfig& config);

// Checks `step` against the manager and the config; throws InvalidArgument
// (UnknownId for a request the manager does not hold) naming the field,
// before anything changes.
void check_step(const char* fn, const StepOutput& step, const KVCacheManager& manager, const BackendConfig& config);

// Fills `inputs` from a checked step (reusing its vectors' capacity).
void build_inputs(const StepOutput& step, const KVCacheManager& manager, StepInputs& inputs);

// store()/attend() argument checks, InvalidArgument / IndexOutOfRange naming
// the argument. `align` is the byte alignment every array's data must have.
void check_store(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                 const TensorView& k, const TensorView& v, DeviceKind device, std::int32_t device_id,
                 std::size_t align);
// prefill(): q, k, v, out (and lse) of the step's prefill rows.
void check_prefill(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                   const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                   const TensorView* lse, DeviceKind device, std::int32_t device_id, std::size_t align);
void check_attend(const char* fn, const StepInputs& inputs, const BackendConfig& config, std::int32_t layer,
                  const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const TensorView* lse, DeviceKind device, std::int32_t device_id, std::size_t align);

// Removes from every layer's FP16 lists the last rows_indptr[i + 1] -
// rows_indptr[i] tokens of batch entry i: the decode rows appended this
// step, which extend attention reads from k and v instead.
void drop_fp16_tails(DecodeMetadata& metadata, std::span<const std::int32_t> rows_indptr, std::int32_t block_size);

// The softmax scale attend() uses.
float sm_scale(const BackendConfig& config);

}  // namespace mixkv::engine_detail
