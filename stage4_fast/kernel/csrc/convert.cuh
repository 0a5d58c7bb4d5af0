// Explicit float <-> 16-bit conversions for the kernels: torch builds extensions with the implicit half/bfloat16
// conversions switched off (-D__CUDA_NO_HALF_CONVERSIONS__ and friends).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace stage4 {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

}  // namespace stage4
