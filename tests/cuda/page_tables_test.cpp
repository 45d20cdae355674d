// Device page tables: the device copy equals the host mirror after upload,
// and an upload sends only the entries that changed (O(changes)).
#include <gtest/gtest.h>

#include <numeric>

#include "cuda_test_util.h"
#include "mixkv/kernels/device_page_tables.h"

namespace mixkv::test {
namespace {

std::vector<std::int32_t> device_row(const gpu::DeviceTablesView& view, int layer, int pool, int slot, int n) {
  std::vector<std::int32_t> row(n);
  const std::size_t at = ((static_cast<std::size_t>(layer) * kNumPrecisions + pool) * view.max_sequences + slot) *
                         view.max_blocks;
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(row.data(), view.blocks + at, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "D2H");
  return row;
}

std::int32_t device_int(const std::int32_t* p) {
  std::int32_t x = 0;
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemcpy(&x, p, sizeof x, cudaMemcpyDeviceToHost), "D2H");
  return x;
}

TEST(DevicePageTablesCuda, UploadsOnlyChanges) {
  MIXKV_REQUIRE_CUDA();
  gpu::DevicePageTables tables({2, 4, 1000});
  std::vector<std::int32_t> list(612);
  std::iota(list.begin(), list.end(), 100);
  tables.set_blocks(3, 1, Precision::INT2, list);
  EXPECT_EQ(tables.pending_updates(), 612u + 1u);  // ids + count
  EXPECT_EQ(tables.upload(nullptr), 613u);
  const auto view = tables.device_view();
  EXPECT_EQ(device_row(view, 1, 2, 3, 612), list);
  EXPECT_EQ(device_int(view.counts + (1 * kNumPrecisions + 2) * 4 + 3), 612);

  // A decode step: one more FP16 token in a fresh tail block.
  std::vector<std::int32_t> fp16 = {7, 8};
  tables.set_blocks(3, 1, Precision::FP16, fp16, 32);
  tables.upload(nullptr);
  fp16.push_back(9);
  tables.set_blocks(3, 1, Precision::FP16, fp16, 1);
  EXPECT_EQ(tables.pending_updates(), 3u);  // new id, count, fill
  tables.set_blocks(3, 1, Precision::FP16, fp16, 2);
  EXPECT_EQ(tables.pending_updates(), 3u);  // the fill is sent once, with its last value
  tables.upload(nullptr);
  EXPECT_EQ(device_row(view, 1, 0, 3, 3), fp16);
  EXPECT_EQ(device_int(view.fp16_fill + 1 * 4 + 3), 2);
  // Unchanged lists send nothing.
  tables.set_blocks(3, 1, Precision::INT2, list);
  EXPECT_EQ(tables.pending_updates(), 0u);
  tables.clear(3);
  EXPECT_EQ(tables.num_blocks(3, 1, Precision::INT2), 0);
  EXPECT_EQ(tables.upload(nullptr), 3u);  // INT2 count, FP16 count, fill of layer 1
}

TEST(DevicePageTablesCuda, BadInputChangesNothing) {
  MIXKV_REQUIRE_CUDA();
  gpu::DevicePageTables tables({1, 2, 4});
  const std::vector<std::int32_t> too_long(5, 1);
  MIXKV_EXPECT_INVALID(tables.set_blocks(0, 0, Precision::INT4, too_long), "max_blocks_per_sequence");
  const std::vector<std::int32_t> negative = {1, -3};
  MIXKV_EXPECT_INVALID(tables.set_blocks(0, 0, Precision::INT4, negative), "blocks[1]");
  EXPECT_THROW(tables.set_blocks(2, 0, Precision::INT4, negative), IndexOutOfRange);
  EXPECT_EQ(tables.pending_updates(), 0u);
}

}  // namespace
}  // namespace mixkv::test
