"""The one-token GEMV (stage4_fast/kernel/triton_gemv.py) against cuBLAS at the Qwen3-0.6B linear shapes (GPU).

    python -m bench gemv-sweep [--json out.json]

For each layer GEMM (qkv, o, gate_up, down) at one row: cuBLAS (torch.matmul) and the Triton GEMV over rows per
program x K slice x warps, each timed as 56 calls in one CUDA graph (the way a decode step runs them), in us per
call and TB/s of weights read; qkv and gate_up with the add-RMSNorm folded in, down with the SiLU-and-mul, as the
engine calls them (cuBLAS: the GEMM alone). With ``--weights cold`` the calls of a graph cycle through 28 weight
matrices (one per layer, as a decode step does), so they read DRAM, not the L2 cache that one matrix read again
and again stays in: a step's GEMVs run cold, and hot figures flatter the small ones. Prints the best GEMV launch
per shape, the engine's current launch, and the layer sum (the four GEMMs) for cuBLAS, the current launch and the
best. This is how GEMV_* were chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Callable

import torch

from stage4_fast.kernel import triton_gemv as tg

from . import meta

# (outputs, inputs, how the engine calls it at one row): the projections after a norm fold the add-RMSNorm in, the
# down projection the SiLU-and-mul of its [gate | up] input (DecoderLayer._forward_one_token)
SHAPES = {"qkv": (4096, 1024, "normed"), "o": (1024, 2048, "plain"), "gate_up": (6144, 1024, "normed"),
          "down": (1024, 3072, "gated")}


LAYERS = 28  # the cold weights: one matrix per layer of the 0.6B shape


def capture_graph(run: Callable[[], None], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``run`` called ``warmup`` times (compiles, allocator), then captured in one CUDA graph."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 3) -> float:
    """Device time per replay of ``graph``, in ms (after ``warmup`` untimed replays)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_us(fn, calls: int = 50, replays: int = 5) -> float:
    """Device time per call of ``fn(i)`` (i = the call's index) captured ``calls`` times in one CUDA graph."""
    for i in range(3):
        fn(i)
    graph = capture_graph(lambda: [fn(i) for i in range(calls)], warmup=0)
    return replay_ms(graph, replays, warmup=1) * 1e3 / calls


def sweep_shape(n: int, k: int, kind: str, cold: bool, grid: list[list[int]], dev: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """cuBLAS (the GEMM alone) and every GEMV launch of ``grid`` (rows, K slices, warps) at one row, N outputs, K
    inputs, the GEMV called as the engine calls it (``kind``: plain, normed, gated)."""
    weights = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(LAYERS if cold else 1)]
    x = torch.randn(1, 2 * k if kind == "gated" else k, device=dev, dtype=dtype)
    residual, norm_weight = torch.randn_like(x), torch.rand(k, device=dev, dtype=dtype) + 0.5
    out = torch.empty(1, n, device=dev, dtype=dtype)
    if kind == "gated":
        ref = torch.matmul(torch.nn.functional.silu(x[:, :k]) * x[:, k:], weights[0].t())
    elif kind == "normed":
        ref = torch.matmul(torch.nn.functional.rms_norm(x + residual, (k,), norm_weight, 1e-6), weights[0].t())
    else:
        ref = torch.matmul(x, weights[0].t())
    cublas = graph_us(lambda i: torch.matmul(x[:, :k], weights[i % len(weights)].t(), out=out), calls=2 * LAYERS)
    rows = []
    for block_n, block_k, warps in itertools.product(*grid):
        def run(i: int, launch: tuple[int, int, int] = (block_n, block_k, warps)) -> torch.Tensor:
            w = weights[i % len(weights)]
            if kind == "normed":
                return tg.normed_gemv(x, residual, norm_weight, 1e-6, w, launch=launch)[0]
            return tg.gemv(x, w, gated=kind == "gated", launch=launch)
        try:
            err = (run(0).float() - ref.float()).abs().max().item()
            rows.append(dict(block_n=block_n, block_k=block_k, warps=warps, us=graph_us(run, calls=2 * LAYERS),
                             err=err))
        except Exception as e:  # noqa: BLE001 (a launch that does not fit is skipped)
            print(f"N {n} K {k} {block_n}/{block_k}/{warps}: {type(e).__name__} {str(e)[:120]}")
    rows.sort(key=lambda r: r["us"])
    return dict(n=n, k=k, cublas_us=cublas, gemv=rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gemv-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every timing here (with the run's date, commit, versions)")
    ap.add_argument("--weights", default="hot", choices=["hot", "cold"],
                    help="one weight matrix read by every call (L2-resident), or one per layer (from DRAM)")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16], help="output rows per program to try")
    ap.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024], help="K slices to try")
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8], help="warp counts to try")
    args = ap.parse_args(argv)
    results: dict = {}
    current = {}
    for name, (n, k, kind) in SHAPES.items():
        launch = tg.gemv_launch(n)
        grid = [args.rows, args.block_k, args.warps]
        for i, value in enumerate(launch):  # the engine's own launch is always measured
            grid[i] = sorted(set(grid[i]) | {value})
        res = results[name] = sweep_shape(n, k, kind, args.weights == "cold", grid)
        rows, cublas = res["gemv"], res["cublas_us"]
        cur = next(r for r in rows if (r["block_n"], r["block_k"], r["warps"]) == launch)
        current[name] = cur["us"]
        best = rows[0]
        gb = n * k * 2 / 1e6
        print(f"{name:8s} N {n:5d} K {k:5d}: cuBLAS {cublas:6.2f} us ({gb / cublas:.2f} TB/s); GEMV current "
              f"{cur['us']:6.2f} us ({gb / cur['us']:.2f} TB/s); best {best['us']:6.2f} us "
              f"({gb / best['us']:.2f} TB/s) at rows {best['block_n']}, K slice {best['block_k']}, warps "
              f"{best['warps']}; max |diff| to the torch reference {cur['err']:.3g}", flush=True)
    layer = {"cublas": sum(r["cublas_us"] for r in results.values()), "gemv_current": sum(current.values()),
             "gemv_best": sum(r["gemv"][0]["us"] for r in results.values())}
    print("layer (four GEMMs): " + ", ".join(f"{k} {v:.1f} us" for k, v in layer.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench gemv-sweep", argv, gpu=True), "results": results,
                       "layer": layer}, f)
    return 0
