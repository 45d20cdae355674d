// The BF16 instances of the store_prefill kernels (store_kernels.cuh), a
// compile job of their own beside store.cu's FP16 ones.
#include "store_kernels.cuh"

namespace mixkv::gpu::store_kernels {

template StoreKernel store_kernel<__nv_bfloat16>(int head_dim, int block_size);

}  // namespace mixkv::gpu::store_kernels
