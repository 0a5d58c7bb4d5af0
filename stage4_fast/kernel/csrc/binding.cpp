// Torch binding of the copy kernels: argument checks, then a launch on the current CUDA stream.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "decode_fp8.h"

int stage4_store_cache(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                       const void* v, int64_t num_tokens, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                       int64_t cache_stride, cudaStream_t stream);
int stage4_store_cache_fp8(void* k_cache, void* v_cache, const void* indices, int index_bytes, const void* k,
                           const void* v, int in_dtype, int e5m2, int64_t num_tokens, int64_t row_elems,
                           int64_t k_stride, int64_t v_stride, float k_scale, float v_scale, cudaStream_t stream);
int stage4_indexing(const void* weights, const void* indices, int index_bytes, void* output, int64_t num_rows,
                    int64_t row_bytes, int64_t weight_stride, int64_t out_stride, int64_t start, int64_t length,
                    cudaStream_t stream);
int stage4_decode_fp8(const stage4::DecodeFp8Args& args, int q_dtype, int e5m2, int batch, int num_kv_heads,
                      int direct, cudaStream_t stream);

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

// Split-K decode attention over an fp8 pool (decode_fp8.cu). q [B, Hq, 128] fp16/bf16; k_cache / v_cache
// [slots, Hkv, 128] fp8 with contiguous rows; page_table [rows, width] int32 (width a multiple of 4); table_idx /
// seq_lens [B] int32. One split writes `out`; more write mid_o [B, Hq, S', 128] / mid_lse [B, Hq, S'] (fp32) for the
// merge kernel. `pdl` launches it with programmatic dependent launch (kernel/pdl.py).
void decode_fp8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor page_table,
                torch::Tensor table_idx, torch::Tensor seq_lens, torch::Tensor mid_o, torch::Tensor mid_lse,
                torch::Tensor out, double scale_log2, double v_scale, int64_t num_splits, int64_t stages,
                bool heads_first, int64_t warps, bool pdl) {
  const int64_t batch = q.size(0), num_qo_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with contiguous rows");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.stride(2) == 1, "out must be like q");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(kv_type == at::ScalarType::Float8_e4m3fn || kv_type == at::ScalarType::Float8_e5m2,
              "decode_fp8 needs a float8_e4m3fn or float8_e5m2 pool");
  TORCH_CHECK(v_cache.scalar_type() == kv_type && k_cache.dim() == 3 && v_cache.dim() == 3, "K/V pools differ");
  TORCH_CHECK(head_dim == 128 && k_cache.size(2) == 128 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "decode_fp8 handles head_dim 128 with contiguous rows");
  TORCH_CHECK(num_qo_heads % num_kv_heads == 0 && num_qo_heads / num_kv_heads <= 8, "at most 8 query heads per KV head");
  TORCH_CHECK((k_cache.stride(0) | k_cache.stride(1) | v_cache.stride(0) | v_cache.stride(1)) % 16 == 0 &&
                  (reinterpret_cast<std::uintptr_t>(k_cache.data_ptr()) |
                   reinterpret_cast<std::uintptr_t>(v_cache.data_ptr())) % 16 == 0,
              "K/V rows must be 16-byte aligned");
  TORCH_CHECK(k_cache.stride(0) < (int64_t{1} << 32) && v_cache.stride(0) < (int64_t{1} << 32), "row stride too large");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.stride(1) == 1 && page_table.stride(0) % 4 == 0 &&
                  reinterpret_cast<std::uintptr_t>(page_table.data_ptr()) % 16 == 0,
              "page_table must be int32 with rows of a multiple of 4 entries");
  TORCH_CHECK(table_idx.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "table_idx/seq_lens int32");
  TORCH_CHECK(num_splits >= 1, "num_splits must be positive");
  TORCH_CHECK(stages >= 2 && stages <= 4, "stages must be 2, 3 or 4");
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8");
  const bool direct = num_splits == 1;
  if (!direct) {
    TORCH_CHECK(mid_o.scalar_type() == at::kFloat && mid_lse.scalar_type() == at::kFloat, "split scratch is fp32");
    TORCH_CHECK(mid_o.size(0) >= batch && mid_o.size(2) >= num_splits && mid_o.stride(3) == 1 &&
                    mid_lse.size(2) >= num_splits,
                "split scratch too small");
  }
  stage4::DecodeFp8Args args{};
  args.q = q.data_ptr();
  args.k_cache = static_cast<const uint8_t*>(k_cache.data_ptr());
  args.v_cache = static_cast<const uint8_t*>(v_cache.data_ptr());
  args.page_table = page_table.data_ptr<int32_t>();
  args.table_idx = table_idx.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.out = out.data_ptr();
  args.stride_qb = q.stride(0);
  args.stride_qh = q.stride(1);
  args.stride_kt = k_cache.stride(0);
  args.stride_kh = k_cache.stride(1);
  args.stride_vt = v_cache.stride(0);
  args.stride_vh = v_cache.stride(1);
  args.stride_pt = page_table.stride(0);
  args.stride_ob = out.stride(0);
  args.stride_oh = out.stride(1);
  if (!direct) {
    args.mid_o = mid_o.data_ptr<float>();
    args.mid_lse = mid_lse.data_ptr<float>();
    args.stride_mob = mid_o.stride(0);
    args.stride_moh = mid_o.stride(1);
    args.stride_mos = mid_o.stride(2);
    args.stride_mlb = mid_lse.stride(0);
    args.stride_mlh = mid_lse.stride(1);
  }
  args.scale_log2 = static_cast<float>(scale_log2);
  args.v_scale = static_cast<float>(v_scale);
  args.num_splits = static_cast<int>(num_splits);
  args.group = static_cast<int>(num_qo_heads / num_kv_heads);
  args.stages = static_cast<int>(stages);
  args.heads_first = heads_first ? 1 : 0;
  args.warps = static_cast<int>(warps);
  args.pdl = pdl ? 1 : 0;
  const int err = stage4_decode_fp8(args, q.scalar_type() == at::kHalf ? 1 : 2,
                                    kv_type == at::ScalarType::Float8_e5m2 ? 1 : 0, static_cast<int>(batch),
                                    static_cast<int>(num_kv_heads), direct ? 1 : 0,
                                    c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "decode_fp8 launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_cache", &store_cache, "scatter K/V rows into the KV pool at token slots");
  m.def("store_cache_fp8", &store_cache_fp8, "scatter K/V rows into an fp8 KV pool, divided by the scales");
  m.def("indexing", &indexing, "row gather with an optional vocab range");
  m.def("decode_fp8", &decode_fp8, "split-K decode attention over an fp8 KV pool (tensor cores)");
}
