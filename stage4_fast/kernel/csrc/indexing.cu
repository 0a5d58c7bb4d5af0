// indexing: row gather (embedding lookup). With a vocab range [start, start + length), rows whose index falls
// outside it are written as zeros and the others are read at index - start: one rank's share of a
// vocab-parallel embedding, summed across ranks afterwards. One warp per output row.
#include "common.cuh"

namespace stage4 {

template <typename Vec, typename Index>
__global__ void indexing_kernel(const char* __restrict__ weights, const Index* __restrict__ indices,
                                char* __restrict__ output, int64_t num_rows, int64_t row_vecs, int64_t weight_stride,
                                int64_t out_stride, int64_t start, int64_t length) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (row >= num_rows) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t local = static_cast<int64_t>(indices[row]) - start;
  Vec* dst = reinterpret_cast<Vec*>(output + row * out_stride);
  if (local < 0 || local >= length) {
    Vec zero;
    memset(&zero, 0, sizeof(Vec));
    for (int64_t i = lane; i < row_vecs; i += kWarpSize) dst[i] = zero;
    return;
  }
  const Vec* src = reinterpret_cast<const Vec*>(weights + local * weight_stride);
  for (int64_t i = lane; i < row_vecs; i += kWarpSize) dst[i] = src[i];
}

template <int kBytes, typename Index>
void launch_indexing(const void* weights, const void* indices, void* output, int64_t num_rows, int64_t row_bytes,
                     int64_t weight_stride, int64_t out_stride, int64_t start, int64_t length, cudaStream_t stream) {
  using Vec = typename VecOf<kBytes>::type;
  const unsigned blocks = static_cast<unsigned>((num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  indexing_kernel<Vec, Index><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
      static_cast<const char*>(weights), static_cast<const Index*>(indices), static_cast<char*>(output), num_rows,
      row_bytes / kBytes, weight_stride, out_stride, start, length);
}

template <typename Index>
void dispatch_indexing(int bytes, const void* weights, const void* indices, void* output, int64_t num_rows,
                       int64_t row_bytes, int64_t weight_stride, int64_t out_stride, int64_t start, int64_t length,
                       cudaStream_t stream) {
  switch (bytes) {
    case 16: return launch_indexing<16, Index>(weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
    case 8: return launch_indexing<8, Index>(weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
    case 4: return launch_indexing<4, Index>(weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
    case 2: return launch_indexing<2, Index>(weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
    default: return launch_indexing<1, Index>(weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
  }
}

}  // namespace stage4

// Sizes and strides in bytes; [start, start + length) is the vocab range (length = rows for a full table).
int stage4_indexing(const void* weights, const void* indices, int index_bytes, void* output, int64_t num_rows,
                    int64_t row_bytes, int64_t weight_stride, int64_t out_stride, int64_t start, int64_t length,
                    cudaStream_t stream) {
  if (num_rows == 0) return 0;
  const std::uintptr_t mask = reinterpret_cast<std::uintptr_t>(weights) | reinterpret_cast<std::uintptr_t>(output) |
                              static_cast<std::uintptr_t>(row_bytes) | static_cast<std::uintptr_t>(weight_stride) |
                              static_cast<std::uintptr_t>(out_stride);
  const int bytes = stage4::vector_bytes(mask);
  if (index_bytes == 4) {
    stage4::dispatch_indexing<int32_t>(bytes, weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
  } else {
    stage4::dispatch_indexing<int64_t>(bytes, weights, indices, output, num_rows, row_bytes, weight_stride, out_stride, start, length, stream);
  }
  return static_cast<int>(cudaGetLastError());
}
