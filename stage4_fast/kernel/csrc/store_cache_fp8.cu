// store_cache_fp8: the KV store of an fp8 pool. Every element of this step's K and V rows is divided by its
// tensor's scale and rounded to fp8 (to nearest, ties to even, saturating at the largest finite value: the torch
// reference `quantize_kv` in kernel/ref.py does the same), then written to its token slot. One block per token;
// each thread converts 8 consecutive elements of K and of V (one 16-byte load of bf16/fp16, one 8-byte store)
// where sizes, strides and addresses allow it, else single elements. K/V may be row-strided views (slices of a
// fused qkv tensor), the cache rows are contiguous bytes.
//
// Why vectors: the first version (one warp per token, one element per lane and step) kept 32 dependent byte
// stores per lane in flight and took ~18 us per layer at 223 tokens on the H200, 0.5 ms of a 6.6 ms decode step.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "convert.cuh"

namespace stage4 {

constexpr int kStoreThreads = 128;
constexpr int kPack = 8;  // elements per thread and step on the vector path

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ uint8_t quantize(float x, float scale, __nv_fp8_interpretation_t kind) {
  // an IEEE division (no fast math in the build), so that the reference's x / scale rounds the same way
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, kind);
}

template <typename In, bool kVector>
__device__ __forceinline__ void quantize_row(uint8_t* __restrict__ dst, const In* __restrict__ src, int64_t elems,
                                             float scale, __nv_fp8_interpretation_t kind) {
  if constexpr (kVector) {
    for (int64_t c = threadIdx.x; c < elems / kPack; c += blockDim.x) {
      const Pack<In, kPack> in = reinterpret_cast<const Pack<In, kPack>*>(src)[c];
      Pack<uint8_t, kPack> out;
#pragma unroll
      for (int i = 0; i < kPack; ++i) out.v[i] = quantize(to_float(in.v[i]), scale, kind);
      reinterpret_cast<Pack<uint8_t, kPack>*>(dst)[c] = out;
    }
  } else {
    for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) dst[i] = quantize(to_float(src[i]), scale, kind);
  }
}

template <typename In, typename Index, bool kVector>
__global__ void store_cache_fp8_kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                                       const Index* __restrict__ indices, const char* __restrict__ k,
                                       const char* __restrict__ v, int64_t row_elems, int64_t k_stride,
                                       int64_t v_stride, float k_scale, float v_scale,
                                       __nv_fp8_interpretation_t kind) {
  const int64_t token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(indices[token]);
  quantize_row<In, kVector>(k_cache + slot * row_elems, reinterpret_cast<const In*>(k + token * k_stride), row_elems,
                            k_scale, kind);
  quantize_row<In, kVector>(v_cache + slot * row_elems, reinterpret_cast<const In*>(v + token * v_stride), row_elems,
                            v_scale, kind);
}

template <typename In, typename Index>
void launch_store_cache_fp8(void* k_cache, void* v_cache, const void* indices, const void* k, const void* v,
                            int64_t num_tokens, int64_t row_elems, int64_t k_stride, int64_t v_stride, float k_scale,
                            float v_scale, __nv_fp8_interpretation_t kind, cudaStream_t stream) {
  // the vector path needs whole packs: rows of a multiple of 8 elements, 8*sizeof(In)-aligned sources and
  // 8-aligned cache rows
  const std::uintptr_t in_align = sizeof(In) * kPack - 1;
  const bool vector = row_elems % kPack == 0 &&
                      ((reinterpret_cast<std::uintptr_t>(k) | reinterpret_cast<std::uintptr_t>(v) |
                        static_cast<std::uintptr_t>(k_stride) | static_cast<std::uintptr_t>(v_stride)) &
                       in_align) == 0 &&
                      ((reinterpret_cast<std::uintptr_t>(k_cache) | reinterpret_cast<std::uintptr_t>(v_cache)) &
                       (kPack - 1)) == 0;
  const unsigned blocks = static_cast<unsigned>(num_tokens);
  auto* kc = static_cast<uint8_t*>(k_cache);
  auto* vc = static_cast<uint8_t*>(v_cache);
  const auto* idx = static_cast<const Index*>(indices);
  const auto* ks = static_cast<const char*>(k);
  const auto* vs = static_cast<const char*>(v);
  if (vector) {
    store_cache_fp8_kernel<In, Index, true><<<blocks, kStoreThreads, 0, stream>>>(
        kc, vc, idx, ks, vs, row_elems, k_stride, v_stride, k_scale, v_scale, kind);
  } else {
    store_cache_fp8_kernel<In, Index, false><<<blocks, kStoreThreads, 0, stream>>>(
        kc, vc, idx, ks, vs, row_elems, k_stride, v_stride, k_scale, v_scale, kind);
  }
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
