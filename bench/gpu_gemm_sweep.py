"""Decode-batch GEMMs (tens to hundreds of rows) at the Qwen3-0.6B linear shapes: cuBLAS, cuBLASLt and a split-K
Triton GEMM over its launch grid (GPU): whether the engine should leave cuBLAS at decode batch sizes.

    python -m bench gemm-sweep [--rows 64 128 224] [--json out.json]

Each GEMM is timed as 56 calls in one CUDA graph cycling through 28 weight matrices (one per layer, so the weights
come from DRAM as in a decode step), in us per call. Prints per row count and shape cuBLAS, cuBLASLt and the best
Triton launches, and the layer sum (the four GEMMs) of each.

The candidate: one program may cover all the rows of the batch (``block_m`` up to 256) for a slice of the outputs,
so that the activation rows cross L2 about N / block_n times (cuBLAS's small output tiles re-read them from L2 for
every tile), and K is split (``splits``) so that there are enough programs to keep every SM's loads in flight.
Split-K without a second kernel and without atomics on the values: each split stores its fp32 partial tile, then
counts itself in on the tile's counter (an acq_rel atomic); the split that arrives last sums the partials in split
order (deterministic whatever order they finished in), writes the output and resets the counter. On the H200 it
lost to cuBLAS at every shape but one, the down projection at 64 rows (bench/results/h200-gemm-sweep.md), so the
engine keeps cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from typing import Dict

import torch
import triton
import triton.language as tl

from . import meta
from .gpu_gemv_sweep import LAYERS, SHAPES, graph_us


@triton.jit
def _splitk_gemm_kernel(X, W, Y, Partials, Counters, M, N, stride_xm, stride_wn, stride_ym, k_split, splits,
                        DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: neighbouring programs share the rows of x through L2
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * k_split + tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_split, BLOCK_K):  # k_split is a multiple of BLOCK_K (launch_applies)
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if DIRECT:  # one split: its sums are final
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = Partials + tile.to(tl.int64) * splits * tile_elems
        tl.store(base + split * tile_elems + local, acc)
        tl.debug_barrier()  # every thread's partial is stored before the count below releases them
        arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last split of this tile: the others' partials are visible
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(splits):  # split order, whatever order they finished in
                total += tl.load(base + s * tile_elems + local, cache_modifier=".cg")  # from L2, not a stale L1
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call


@dataclass(frozen=True)
class GemmLaunch:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    warps: int
    stages: int


# The tiles' arrival counters: zeros between calls (the last split of a tile resets its own). One fixed buffer per
# device, allocated before any graph captures a launch, so every captured graph keeps pointing at a live buffer.
MAX_TILES = 1 << 14
_counters: Dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def launch_applies(m: int, n: int, k: int, launch: GemmLaunch) -> bool:
    if k % (launch.splits * launch.block_k) != 0:
        return False
    tiles = triton.cdiv(m, launch.block_m) * triton.cdiv(n, launch.block_n)
    return launch.splits == 1 or tiles <= MAX_TILES


def gemm(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, with ``launch`` (see ``launch_applies``); x and weight 16-bit."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(m, launch.block_m), launch.splits)
    if launch.splits == 1:
        partials, counters = out, out  # unused
    else:
        partials = torch.empty(grid[0] * grid[1] * launch.splits * launch.block_m * launch.block_n,
                               device=x.device, dtype=torch.float32)
        counters = _tile_counters(x.device)
    _splitk_gemm_kernel[grid](
        x, weight, out, partials, counters, m, n, x.stride(0), weight.stride(0), out.stride(0),
        k // launch.splits, launch.splits,
        DIRECT=launch.splits == 1, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, num_warps=launch.warps, num_stages=launch.stages,
    )
    return out


SHARED_MEMORY = 227 * 1024  # an H100/H200 SM's shared memory per block


def fits(launch: GemmLaunch) -> bool:
    """Whether the launch's pipelined x and W tiles fit shared memory (16-bit values)."""
    return launch.stages * (launch.block_m + launch.block_n) * launch.block_k * 2 <= SHARED_MEMORY


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
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 224], help="batch rows (M) to time")
    ap.add_argument("--block-m", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    args = ap.parse_args(argv)
    dev, dtype = "cuda", torch.bfloat16
    launches = [GemmLaunch(*la) for la in itertools.product(args.block_m, args.block_n, args.block_k, args.splits,
                                                             args.warps, args.stages)]
    # 256-row tiles want two warp groups; 64-row tiles one
    launches = [la for la in launches if fits(la) and not (la.block_m == 256 and la.warps == 4)
                and not (la.block_m == 64 and la.warps == 8)]
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
                if not launch_applies(m, n, k, launch):
                    continue
                try:
                    err = (gemm(x, weights[0], launch).float() - ref).abs().max().item()
                    us = graph_us(lambda i, la=launch, x=x, ws=weights, o=out: gemm(x, ws[i % LAYERS], la, out=o),
                                  calls=2 * LAYERS)
                except Exception as e:  # noqa: BLE001 (a launch that does not fit is skipped)
                    print(f"{name} M {m} {launch}: {type(e).__name__} {str(e)[:100]}")
                    continue
                row["triton"].append(dict(launch=list(launch.__dict__.values()), us=us, err=err))
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
