// cuBLASLt GEMM with an algorithm chosen by the caller: out[M, N] = x[M, K] · w[N, K]^T, 16-bit values, fp32
// accumulation (what F.linear computes). cuBLAS picks one algorithm per shape from its heuristic; at decode batch
// sizes (tens to hundreds of rows) that pick may not be the fastest: `python -m bench cublaslt-sweep`
// (bench/gpu_cublaslt_sweep.py) times every candidate the heuristic offers against F.linear.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace {

#define LT_CHECK(expr)                                                                         \
  do {                                                                                         \
    const cublasStatus_t status_ = (expr);                                                     \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #expr " failed with cuBLAS status ", status_); \
  } while (0)

// Everything a plan depends on: the shape, the dtype, the leading dimensions and the workspace it may use.
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int, int64_t, int64_t, int64_t, int64_t>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr, x_layout = nullptr, out_layout = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
};

// One plan per shape for the process's life: an engine has a handful of projections times its graph batch sizes.
std::map<PlanKey, Plan>& plans() {
  static std::map<PlanKey, Plan> cache;
  return cache;
}

constexpr int kMaxCandidates = 64;
constexpr int64_t kAlignment = 16;  // the pointers' alignment the candidates may assume (checked on every call)

cudaDataType_t cuda_type(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "cuBLASLt GEMM: 16-bit only");
  return t.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

void check_operands(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& out,
                    const torch::Tensor& workspace) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda() && workspace.is_cuda(), "CUDA tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "2-D x, w and out expected");
  TORCH_CHECK(x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0), "shape mismatch");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() == out.scalar_type(), "dtype mismatch");
  for (const auto* t : {&x, &w, &out}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % kAlignment == 0 &&
                    (t->stride(0) * t->element_size()) % kAlignment == 0,
                "cuBLASLt GEMM operands must be 16-byte aligned");
  }
}

Plan& plan_for(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& out,
               const torch::Tensor& workspace) {
  check_operands(x, w, out, workspace);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const cudaDataType_t type = cuda_type(x);
  const uint64_t workspace_bytes = workspace.numel() * workspace.element_size();
  const PlanKey key{m, n, k, static_cast<int>(type), x.stride(0), w.stride(0), out.stride(0),
                    static_cast<int64_t>(workspace_bytes)};
  auto found = plans().find(key);
  if (found != plans().end()) return found->second;

  // Column-major view of row-major tensors: out^T [N, M] = w^T^T [N, K] · x^T [K, M], so w is operand A
  // (transposed) and x operand B, as torch's own F.linear call to cuBLAS.
  Plan plan;
  LT_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan.w_layout, type, k, n, w.stride(0)));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan.x_layout, type, k, m, x.stride(0)));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan.out_layout, type, n, m, out.stride(0)));

  cublasLtMatmulPreference_t preference = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof(workspace_bytes)));
  const uint32_t alignment = kAlignment;
  for (const auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attr, &alignment, sizeof(alignment)));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(kMaxCandidates);
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      at::cuda::getCurrentCUDABlasLtHandle(), plan.desc, plan.w_layout, plan.x_layout, plan.out_layout,
      plan.out_layout, preference, kMaxCandidates, results.data(), &returned);
  cublasLtMatmulPreferenceDestroy(preference);
  LT_CHECK(status);
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan.candidates.push_back(results[i]);
  }
  return plans().emplace(key, plan).first->second;
}

int config_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t value = 0;  // the attributes read here are all 32-bit; -1 where this cuBLAS version lacks one
  size_t written = 0;
  const auto status = cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written);
  return status == CUBLAS_STATUS_SUCCESS ? static_cast<int>(value) : -1;
}

}  // namespace

// How many algorithms cuBLASLt's heuristic offers for this GEMM (builds its plan once).
int64_t lt_candidates(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor workspace) {
  return static_cast<int64_t>(plan_for(x, w, out, workspace).candidates.size());
}

// Candidate ``index``'s configuration: algorithm id, tile id, K splits, stages id, cluster shape id, workspace
// bytes, estimated waves (x1000): what the results files record next to its time.
std::vector<int64_t> lt_describe(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor workspace,
                                 int64_t index) {
  const Plan& plan = plan_for(x, w, out, workspace);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(plan.candidates.size()), "no such candidate");
  const auto& result = plan.candidates[index];
  return {config_value(result.algo, CUBLASLT_ALGO_CONFIG_ID),
          config_value(result.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
          config_value(result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
          config_value(result.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
          config_value(result.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
          static_cast<int64_t>(result.workspaceSize),
          static_cast<int64_t>(result.wavesCount * 1000)};
}

// out = x · w^T with candidate ``index`` on the current stream (capturable in a CUDA graph: no allocation, no sync).
void lt_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor workspace, int64_t index) {
  const Plan& plan = plan_for(x, w, out, workspace);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(plan.candidates.size()), "no such candidate");
  const auto& result = plan.candidates[index];
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), plan.desc, &alpha, w.data_ptr(), plan.w_layout,
                          x.data_ptr(), plan.x_layout, &beta, out.data_ptr(), plan.out_layout, out.data_ptr(),
                          plan.out_layout, &result.algo, workspace.data_ptr(), result.workspaceSize,
                          c10::cuda::getCurrentCUDAStream().stream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lt_candidates", &lt_candidates, "number of cuBLASLt heuristic candidates for out = x @ w.T");
  m.def("lt_describe", &lt_describe, "a candidate's configuration");
  m.def("lt_matmul", &lt_matmul, "out = x @ w.T with the given candidate");
}
