// The torch side of cutlass_gemm.cu (which stays plain CUDA): out[M, N] = x[M, K] . w[N, K]^T on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <string>

int bench_cutlass_gemm(const char* config, const void* A, const void* B, void* D, int M, int N, int K,
                       cudaStream_t stream, bool pdl, void* workspace);

// x [M, K], w [N, K], out [M, N]: bf16, contiguous; workspace: a byte buffer of at least 1 MiB.
void cutlass_linear(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor workspace,
                    const std::string& config, bool pdl) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(workspace.numel() >= (1 << 20), "a workspace of at least 1 MiB");
  const int rc = bench_cutlass_gemm(config.c_str(), x.data_ptr(), w.data_ptr(), out.data_ptr(),
                                    static_cast<int>(x.size(0)), static_cast<int>(w.size(0)),
                                    static_cast<int>(x.size(1)), c10::cuda::getCurrentCUDAStream().stream(), pdl,
                                    workspace.data_ptr());
  TORCH_CHECK(rc == 0, "CUTLASS GEMM ", config, " failed (", rc, ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cutlass_linear", &cutlass_linear, "a CUTLASS sm90 GEMM that waits for the kernel before it");
}
