#pragma once
// Lets the layout and arithmetic headers be shared by host C++ and CUDA code.
#if defined(__CUDACC__)
#define MIXKV_HOST_DEVICE __host__ __device__
#else
#define MIXKV_HOST_DEVICE
#endif
