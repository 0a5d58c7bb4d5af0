// Torch binding of the copy kernels: argument checks, then a launch on the current CUDA stream.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

int stage4_store_cache(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                       const void* v, int64_t num_tokens, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                       int64_t cache_stride, cudaStream_t stream);
int stage4_store_cache_fp8(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                           const void* v, int in_dtype, int e5m2, int64_t num_tokens, int64_t row_elems,
                           int64_t k_stride, int64_t v_stride, float k_scale, float v_scale, cudaStream_t stream);
int stage4_indexing(const void* weights, const void* indices, int index_bytes, void* output, int64_t num_rows,
                    int64_t row_bytes, int64_t weight_stride, int64_t out_stride, int64_t start, int64_t length,
                    cudaStream_t stream);

namespace {

// A 2-D view [rows, row_bytes] whose rows are contiguous: returns its row stride in bytes.
int64_t row_stride_bytes(const torch::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() >= 1 && t.size(0) == rows, name, " has the wrong number of rows");
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expected, name, " rows must be contiguous");
    expected *= t.size(d);
  }
  return (t.dim() == 1 ? 1 : t.stride(0)) * static_cast<int64_t>(t.element_size());
}

void check_indices(const torch::Tensor& indices) {
  TORCH_CHECK(indices.is_cuda() && indices.dim() == 1 && indices.is_contiguous(), "indices must be 1-D CUDA");
  TORCH_CHECK(indices.scalar_type() == torch::kInt32 || indices.scalar_type() == torch::kInt64,
              "indices must be int32 or int64");
}

}  // namespace

void store_cache(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor indices, torch::Tensor k,
                 torch::Tensor v) {
  check_indices(indices);
  const int64_t num_tokens = indices.size(0);
  if (num_tokens == 0) return;
  const int64_t row_bytes = k.numel() / std::max<int64_t>(num_tokens, 1) * k.element_size();
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.numel() % (row_bytes / k_cache.element_size()) == 0, "cache row size mismatch");
  const int64_t cache_stride = row_bytes;
  const int64_t k_stride = row_stride_bytes(k, num_tokens, "k");
  const int64_t v_stride = row_stride_bytes(v, num_tokens, "v");
  const int err = stage4_store_cache(k_cache.data_ptr(), v_cache.data_ptr(), indices.data_ptr(),
                                     static_cast<int>(indices.element_size()), k.data_ptr(), v.data_ptr(), num_tokens,
                                     row_bytes, k_stride, v_stride, cache_stride,
                                     c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "store_cache launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void store_cache_fp8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor indices, torch::Tensor k,
                     torch::Tensor v, double k_scale, double v_scale) {
  check_indices(indices);
  const int64_t num_tokens = indices.size(0);
  if (num_tokens == 0) return;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == at::ScalarType::Float8_e4m3fn || cache_type == at::ScalarType::Float8_e5m2,
              "store_cache_fp8 needs float8_e4m3fn or float8_e5m2 caches");
  const auto in_type = k.scalar_type();
  TORCH_CHECK(in_type == at::kFloat || in_type == at::kHalf || in_type == at::kBFloat16,
              "K/V rows must be float32, float16 or bfloat16");
  const int in_dtype = in_type == at::kFloat ? 0 : (in_type == at::kHalf ? 1 : 2);
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "KV scales must be positive");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t row_elems = k.numel() / num_tokens;
  TORCH_CHECK(v.numel() == k.numel() && k_cache.numel() % row_elems == 0, "cache row size mismatch");
  const int64_t k_stride = row_stride_bytes(k, num_tokens, "k");
  const int64_t v_stride = row_stride_bytes(v, num_tokens, "v");
  const int err = stage4_store_cache_fp8(
      k_cache.data_ptr(), v_cache.data_ptr(), indices.data_ptr(), static_cast<int>(indices.element_size()),
      k.data_ptr(), v.data_ptr(), in_dtype, cache_type == at::ScalarType::Float8_e5m2 ? 1 : 0, num_tokens,
      row_elems, k_stride, v_stride, static_cast<float>(k_scale), static_cast<float>(v_scale),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "store_cache_fp8 launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void indexing(torch::Tensor weights, torch::Tensor indices, torch::Tensor output, int64_t start, int64_t length) {
  check_indices(indices);
  TORCH_CHECK(weights.dim() == 2 && output.dim() == 2 && weights.size(1) == output.size(1), "shape mismatch");
  TORCH_CHECK(weights.scalar_type() == output.scalar_type(), "dtype mismatch");
  TORCH_CHECK(weights.stride(1) == 1 && output.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(output.size(0) == indices.size(0), "output rows must match indices");
  TORCH_CHECK(length <= weights.size(0), "vocab range longer than the table");
  const int64_t row_bytes = weights.size(1) * weights.element_size();
  const int err = stage4_indexing(weights.data_ptr(), indices.data_ptr(), static_cast<int>(indices.element_size()),
                                  output.data_ptr(), indices.size(0), row_bytes, weights.stride(0) * weights.element_size(),
                                  output.stride(0) * output.element_size(), start, length,
                                  c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "indexing launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_cache", &store_cache, "scatter K/V rows into the KV pool at token slots");
  m.def("store_cache_fp8", &store_cache_fp8, "scatter K/V rows into an fp8 KV pool, divided by the scales");
  m.def("indexing", &indexing, "row gather with an optional vocab range");
}
