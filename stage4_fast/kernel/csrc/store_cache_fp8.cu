// store_cache_fp8: the KV store of an fp8 pool. Every element of this step's K and V rows is divided by its
// tensor's scale and rounded to fp8 (to nearest, ties to even, saturating at the largest finite value: the torch
// reference `quantize_kv` in kernel/ref.py does the same), then written to its token slot. One warp per token;
// K/V may be row-strided views (slices of a fused qkv tensor), the cache rows are contiguous bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"

namespace stage4 {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename In, typename Index>
__global__ void store_cache_fp8_kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                                       const Index* __restrict__ indices, const char* __restrict__ k,
                                       const char* __restrict__ v, int64_t num_tokens, int64_t row_elems,
                                       int64_t k_stride, int64_t v_stride, float k_scale, float v_scale,
                                       __nv_fp8_interpretation_t kind) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= num_tokens) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t slot = static_cast<int64_t>(indices[token]);
  const In* k_src = reinterpret_cast<const In*>(k + token * k_stride);
  const In* v_src = reinterpret_cast<const In*>(v + token * v_stride);
  uint8_t* k_dst = k_cache + slot * row_elems;
  uint8_t* v_dst = v_cache + slot * row_elems;
  for (int64_t i = lane; i < row_elems; i += kWarpSize) {
    // an IEEE division (no fast math in the build), so that the reference's x / scale rounds the same way
    k_dst[i] = __nv_cvt_float_to_fp8(to_float(k_src[i]) / k_scale, __NV_SATFINITE, kind);
    v_dst[i] = __nv_cvt_float_to_fp8(to_float(v_src[i]) / v_scale, __NV_SATFINITE, kind);
  }
}

template <typename In, typename Index>
void launch_store_cache_fp8(void* k_cache, void* v_cache, const void* indices, const void* k, const void* v,
                            int64_t num_tokens, int64_t row_elems, int64_t k_stride, int64_t v_stride, float k_scale,
                            float v_scale, __nv_fp8_interpretation_t kind, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  store_cache_fp8_kernel<In, Index><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
      static_cast<uint8_t*>(k_cache), static_cast<uint8_t*>(v_cache), static_cast<const Index*>(indices),
      static_cast<const char*>(k), static_cast<const char*>(v), num_tokens, row_elems, k_stride, v_stride, k_scale,
      v_scale, kind);
}

template <typename In>
void dispatch_store_cache_fp8(int index_bytes, void* k_cache, void* v_cache, const void* indices, const void* k,
                              const void* v, int64_t num_tokens, int64_t row_elems, int64_t k_stride,
                              int64_t v_stride, float k_scale, float v_scale, __nv_fp8_interpretation_t kind,
                              cudaStream_t stream) {
  if (index_bytes == 4) {
    launch_store_cache_fp8<In, int32_t>(k_cache, v_cache, indices, k, v, num_tokens, row_elems, k_stride, v_stride,
                                        k_scale, v_scale, kind, stream);
  } else {
    launch_store_cache_fp8<In, int64_t>(k_cache, v_cache, indices, k, v, num_tokens, row_elems, k_stride, v_stride,
                                        k_scale, v_scale, kind, stream);
  }
}

}  // namespace stage4

// in_dtype: 0 float32, 1 float16, 2 bfloat16; e5m2: 0 = e4m3 cache, 1 = e5m2 cache. Strides in bytes.
int stage4_store_cache_fp8(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                           const void* v, int in_dtype, int e5m2, int64_t num_tokens, int64_t row_elems,
                           int64_t k_stride, int64_t v_stride, float k_scale, float v_scale, cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  const __nv_fp8_interpretation_t kind = e5m2 ? __NV_E5M2 : __NV_E4M3;
  switch (in_dtype) {
    case 0:
      stage4::dispatch_store_cache_fp8<float>(index_bytes, k_cache, v_cache, indices, k, v, num_tokens, row_elems,
                                              k_stride, v_stride, k_scale, v_scale, kind, stream);
      break;
    case 1:
      stage4::dispatch_store_cache_fp8<__half>(index_bytes, k_cache, v_cache, indices, k, v, num_tokens, row_elems,
                                               k_stride, v_stride, k_scale, v_scale, kind, stream);
      break;
    default:
      stage4::dispatch_store_cache_fp8<__nv_bfloat16>(index_bytes, k_cache, v_cache, indices, k, v, num_tokens,
                                                      row_elems, k_stride, v_stride, k_scale, v_scale, kind, stream);
  }
  return static_cast<int>(cudaGetLastError());
}
