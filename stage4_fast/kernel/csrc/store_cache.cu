// store_cache: scatter this step's K and V rows into the KV pool at their token slots.
// One warp per token; the lanes stride over the row in the widest vector the layout allows. K/V may be
// row-strided views (slices of a fused qkv tensor); the cache rows are contiguous.
#include "common.cuh"

namespace stage4 {

template <typename Vec, typename Index>
__global__ void store_cache_kernel(char* __restrict__ k_cache, char* __restrict__ v_cache,
                                   const Index* __restrict__ indices, const char* __restrict__ k,
                                   const char* __restrict__ v, int64_t num_tokens, int64_t row_vecs,
                                   int64_t k_stride, int64_t v_stride, int64_t cache_stride) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= num_tokens) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t slot = static_cast<int64_t>(indices[token]);
  const Vec* k_src = reinterpret_cast<const Vec*>(k + token * k_stride);
  const Vec* v_src = reinterpret_cast<const Vec*>(v + token * v_stride);
  Vec* k_dst = reinterpret_cast<Vec*>(k_cache + slot * cache_stride);
  Vec* v_dst = reinterpret_cast<Vec*>(v_cache + slot * cache_stride);
  for (int64_t i = lane; i < row_vecs; i += kWarpSize) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

template <int kBytes, typename Index>
void launch_store_cache(void* k_cache, void* v_cache, const void* indices, const void* k, const void* v,
                        int64_t num_tokens, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                        int64_t cache_stride, cudaStream_t stream) {
  using Vec = typename VecOf<kBytes>::type;
  const unsigned blocks = static_cast<unsigned>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  store_cache_kernel<Vec, Index><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
      static_cast<char*>(k_cache), static_cast<char*>(v_cache), static_cast<const Index*>(indices),
      static_cast<const char*>(k), static_cast<const char*>(v), num_tokens, row_bytes / kBytes, k_stride,
      v_stride, cache_stride);
}

template <typename Index>
void dispatch_store_cache(int bytes, void* k_cache, void* v_cache, const void* indices, const void* k,
                          const void* v, int64_t num_tokens, int64_t row_bytes, int64_t k_stride,
                          int64_t v_stride, int64_t cache_stride, cudaStream_t stream) {
  switch (bytes) {
    case 16: return launch_store_cache<16, Index>(k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
    case 8: return launch_store_cache<8, Index>(k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
    case 4: return launch_store_cache<4, Index>(k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
    case 2: return launch_store_cache<2, Index>(k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
    default: return launch_store_cache<1, Index>(k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
  }
}

}  // namespace stage4

// All sizes and strides in bytes. Returns the CUDA launch status.
int stage4_store_cache(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                       const void* v, int64_t num_tokens, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                       int64_t cache_stride, cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  const std::uintptr_t mask = reinterpret_cast<std::uintptr_t>(k_cache) | reinterpret_cast<std::uintptr_t>(v_cache) |
                              reinterpret_cast<std::uintptr_t>(k) | reinterpret_cast<std::uintptr_t>(v) |
                              static_cast<std::uintptr_t>(row_bytes) | static_cast<std::uintptr_t>(k_stride) |
                              static_cast<std::uintptr_t>(v_stride) | static_cast<std::uintptr_t>(cache_stride);
  const int bytes = stage4::vector_bytes(mask);
  if (index_bytes == 4) {
    stage4::dispatch_store_cache<int32_t>(bytes, k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
  } else {
    stage4::dispatch_store_cache<int64_t>(bytes, k_cache, v_cache, indices, k, v, num_tokens, row_bytes, k_stride, v_stride, cache_stride, stream);
  }
  return static_cast<int>(cudaGetLastError());
}
