// Explicit float <-> 16-bit conversions for the kernels: torch builds extensions with the implicit half/bfloat16
// conversions switched off (-D__CUDA_NO_HALF_CONVERSIONS__ and friends).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

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

// x / scale as an fp8 byte: rounded to nearest, ties to even, saturating at the largest finite value. An IEEE
// division (no fast math in the build), so that the torch reference's x / scale (kernel/ref.py) rounds the same way.
__device__ __forceinline__ uint8_t quantize_fp8(float x, float scale, __nv_fp8_interpretation_t kind) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, kind);
}

}  // namespace stage4
