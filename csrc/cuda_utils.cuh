// Small helpers shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

namespace flowkit {

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <typename T>
__device__ __forceinline__ T warp_max(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Sum over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result.
template <typename T>
__device__ __forceinline__ T block_sum(T value) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  value = warp_sum(value);
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  value = lane < warps ? partial[lane] : T(0);
  return warp_sum(value);
}

}  // namespace flowkit
