#pragma once
#include <cstdint>
#include <span>

#include "mixkv/cache/kv_cache_manager.h"
#include "mixkv/core/op_types.h"

namespace mixkv {

// The page lists of the first rows[i] prompt tokens of each sequence, per
// layer and pool: what a prefill chunk starting at row rows[i] attends to
// (extend attention reads them as the cached part; the chunk's own rows
// come as K/V input). Blocks appear in the order of the sequence's page
// lists; each FP16 list is dense (every block full but the last, which
// holds last_block_len of the prefix's tokens), and quantized windows are
// listed once all their tokens are in the prefix.
//
// Holds only while rows[i] is a chunk boundary of the prompt (the tokens
// before it stored, those after it not yet read): an FP16 block the prefix
// shares with later tokens is listed with the prefix's fill only.
// Throws InvalidArgument naming "rows" (size differs from ids) or rows[i]
// (outside [0, prompt tokens], or inside a visual window); UnknownId /
// InvalidArgument as KVCacheManager::prefill_mapping for an unknown or
// swapped-out id.
DecodeMetadata prefix_metadata(const KVCacheManager& cache, std::span<const SequenceId> ids,
                               std::span<const std::int32_t> rows);

}  // namespace mixkv
