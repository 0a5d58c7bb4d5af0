"""Decode-batch GEMMs (tens to hundreds of rows) at the Qwen3-0.6B linear shapes: cuBLAS, cuBLASLt and a tiled
Triton GEMM over its launch grid (GPU): whether the engine should leave cuBLAS at decode batch sizes.

    python -m bench gemm-sweep [--rows 96 160 224] [--json out.json]

Each GEMM is timed as 56 calls in one CUDA graph cycling through 28 weight matrices (one per layer, so the weights
come from DRAM as in a decode step), in us per call. Prints per row count and shape cuBLAS, cuBLASLt and the best
Triton launches, and the layer sum (the four GEMMs) of each.

The candidate: small output tiles so that every SM has work at 64-256 rows (cuBLAS's tiles leave an o_proj of 1,024
outputs 8-16 of them), the row blocks of one weight tile launched side by side so that they share it through L2.
On the H200 it lost to cuBLAS at every shape (bench/results/h200-gemm-sweep.md), so the engine keeps cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from . import meta
from .gpu_gemv_sweep import LAYERS, SHAPES, graph_us


@triton.jit
def _gemm_kernel(X, W, Y, M, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the row blocks that share this program's weight tile run side by side
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K and N of BLOCK_N (gemm_applies)
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=row_ok[:, None])


def gemm_applies(x: torch.Tensor, w: torch.Tensor, launch: tuple[int, int, int, int, int]) -> bool:
    block_m, block_n, block_k, _, _ = launch
    return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and w.is_contiguous() and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % block_n == 0
            and w.shape[1] % block_k == 0 and x.shape[1] == w.shape[1])


def gemm(x: torch.Tensor, w: torch.Tensor, launch: tuple[int, int, int, int, int],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with ``launch`` = (block_m, block_n, block_k, warps, stages)."""
    block_m, block_n, block_k, warps, stages = launch
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, block_m), n // block_n)
    _gemm_kernel[grid](x, w, out, m, k, x.stride(0), w.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def time_blas(x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor, library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return graph_us(lambda i: torch.matmul(x, weights[i % len(weights)].t(), out=out), calls=2 * LAYERS)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gemm-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every timing here (with the run's date, commit, versions)")
    ap.add_argument("--rows", type=int, nargs="+", default=[96, 160, 224], help="batch rows (M) to time")
    ap.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5])
    args = ap.parse_args(argv)
    dev, dtype = "cuda", torch.bfloat16
    launches = list(itertools.product(args.block_m, args.block_n, args.block_k, args.warps, args.stages))
    results: list[dict] = []
    for name, (n, k, _) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            out = torch.empty(m, n, device=dev, dtype=dtype)
            ref = torch.matmul(x, weights[0].t()).float()
            row = dict(shape=name, m=m, n=n, k=k, cublas=time_blas(x, weights, out, "cublas"),
                       cublaslt=time_blas(x, weights, out, "cublaslt"), triton=[])
            for launch in launches:
                if not gemm_applies(x, weights[0], launch):
                    continue
                try:
                    err = (gemm(x, weights[0], launch).float() - ref).abs().max().item()
                    us = graph_us(lambda i, la=launch, x=x, ws=weights, o=out: gemm(x, ws[i % LAYERS], la, out=o),
                                  calls=2 * LAYERS)
                except Exception as e:  # noqa: BLE001 (a launch that does not fit is skipped)
                    print(f"{name} M {m} {launch}: {type(e).__name__} {str(e)[:100]}")
                    continue
                row["triton"].append(dict(launch=launch, us=us, err=err))
            row["triton"].sort(key=lambda r: r["us"])
            best = row["triton"][0] if row["triton"] else dict(launch=None, us=float("nan"), err=float("nan"))
            print(f"{name:8s} M {m:4d} N {n:5d} K {k:5d}: cuBLAS {row['cublas']:6.2f} us, cuBLASLt "
                  f"{row['cublaslt']:6.2f}, Triton best {best['us']:6.2f} at {best['launch']} (err {best['err']:.3g}); "
                  "next: " + ", ".join(f"{r['us']:.2f} {r['launch']}" for r in row["triton"][1:4]), flush=True)
            results.append(row)
    for m in args.rows:
        rows = [r for r in results if r["m"] == m]
        print(f"layer at M {m}: cuBLAS {sum(r['cublas'] for r in rows):.1f} us, cuBLASLt "
              f"{sum(r['cublaslt'] for r in rows):.1f}, Triton best {sum(r['triton'][0]['us'] for r in rows):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench gemm-sweep", argv, gpu=True), "results": results}, f)
    return 0
