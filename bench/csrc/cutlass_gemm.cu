// CUTLASS sm90 GEMMs for `python -m bench layer-chain`: out[M, N] = x[M, K] . w[N, K]^T, bf16 in and out, fp32
// accumulation (what F.linear computes), built with grid dependency control (CUTLASS_ENABLE_GDC_FOR_SM90) so that
// each GEMM executes griddepcontrol.wait before it reads its input and may be launched with programmatic dependent
// launch. cuBLAS's decode GEMMs do not wait (bench/results/h200-gemm-waits.md), so the graph edges into them must
// stay full; these show what edges into GEMMs that do wait would save. Headers: the CUTLASS that FlashInfer's wheel
// carries (flashinfer/data/cutlass/include); built on first use by torch's extension loader, for sm_90a, with
// cutlass_gemm_binding.cpp (the torch side: this file stays plain CUDA).
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"

using namespace cute;

template <class TileShape, class KernelSchedule, class EpilogueSchedule, int kStages = 0>
struct Config {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int Align = 8;
  using ClusterShape = Shape<_1, _1, _1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, Align, ElementD, LayoutD, Align,
      EpilogueSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, Align, ElementB, LayoutB, Align, float,
      TileShape, ClusterShape,
      // kStages 0: as many stages as shared memory holds beside the epilogue; else that many (the unused branch
      // still names a type, hence StageCount<2> there rather than the invalid StageCount<0>)
      std::conditional_t<kStages == 0,
                         cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
                             sizeof(typename CollectiveEpilogue::SharedStorage))>,
                         cutlass::gemm::collective::StageCount<kStages == 0 ? 2 : kStages>>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class Cfg>
int run(const void* A, const void* B, void* D, int M, int N, int K, cudaStream_t stream, int pdl, void* workspace) {
  using Gemm = typename Cfg::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  StrideA sa = make_stride(int64_t(K), Int<1>{}, int64_t(M) * K);
  StrideB sb = make_stride(int64_t(K), Int<1>{}, int64_t(N) * K);
  StrideD sd = make_stride(int64_t(N), Int<1>{}, int64_t(M) * N);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {static_cast<const cutlass::bfloat16_t*>(A), sa, static_cast<const cutlass::bfloat16_t*>(B), sb},
      {{1.f, 0.f}, nullptr, sd, static_cast<cutlass::bfloat16_t*>(D), sd}};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.get_workspace_size(args) > (1 << 20)) return 2;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(stream, nullptr, pdl != 0) != cutlass::Status::kSuccess) return 4;
  return 0;
}

using PingPong64 = Config<Shape<_64, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::epilogue::TmaWarpSpecialized>;
using Coop128 = Config<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                       cutlass::epilogue::TmaWarpSpecializedCooperative>;

using Basic64x64 = Config<Shape<_64, _64, _128>, cutlass::gemm::KernelTmaWarpSpecialized,
                          cutlass::epilogue::NoSmemWarpSpecialized, 4>;

// The configurations, by name: tile (M x N x K) and kernel schedule (the epilogue that schedule builds with).
// Returns 0, or a nonzero code: -1 an unknown name, 1-4 CUTLASS refused or failed (see run).
int bench_cutlass_gemm(const char* config, const void* A, const void* B, void* D, int M, int N, int K,
                       cudaStream_t stream, bool pdl, void* workspace) {
  if (std::strcmp(config, "64x64-basic") == 0) return run<Basic64x64>(A, B, D, M, N, K, stream, pdl, workspace);
  if (std::strcmp(config, "64x128-pingpong") == 0) return run<PingPong64>(A, B, D, M, N, K, stream, pdl, workspace);
  if (std::strcmp(config, "128x128-cooperative") == 0) return run<Coop128>(A, B, D, M, N, K, stream, pdl, workspace);
  return -1;
}
