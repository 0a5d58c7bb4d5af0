"""The one-token GEMV (stage4_fast/kernel/triton_gemv.py) against cuBLAS at the Qwen3-0.6B linear shapes (GPU).

    python -m bench gemv-sweep [--json out.json]

For each layer GEMM (qkv, o, gate_up, down) at one row: cuBLAS (torch.matmul) and the Triton GEMV over rows per
program x K slice x warps, each timed as 50 calls in one CUDA graph (the way a decode step runs them), in us per
call and TB/s of weights read. Prints the best GEMV launch per shape, the engine's current launch, and the layer
sum (the four GEMMs) for cuBLAS, the current launch and the best. This is how GEMV_* were chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from stage4_fast.kernel import triton_gemv as tg

from . import meta

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def graph_us(fn, calls: int = 50, replays: int = 5) -> float:
    """Device time per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def sweep_shape(n: int, k: int, dev: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """cuBLAS and every GEMV launch at one row, N outputs, K inputs."""
    w = torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5
    x = torch.randn(1, k, device=dev, dtype=dtype)
    out = torch.empty(1, n, device=dev, dtype=dtype)
    ref = torch.matmul(x, w.t())
    cublas = graph_us(lambda: torch.matmul(x, w.t(), out=out))
    rows = []
    for block_n, block_k, warps in itertools.product([2, 4, 8, 16], [256, 512, 1024], [2, 4, 8]):
        y = torch.empty(1, n, device=dev, dtype=dtype)

        def run(block_n: int = block_n, block_k: int = block_k, warps: int = warps, y: torch.Tensor = y) -> None:
            tg._gemv_kernel[(-(-n // block_n),)](x, w, w, y, n, k, w.stride(0), HAS_BIAS=False, GATED=False,
                                                 BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        try:
            run()
            err = (y.float() - ref.float()).abs().max().item()
            rows.append(dict(block_n=block_n, block_k=block_k, warps=warps, us=graph_us(run), err=err))
        except Exception as e:  # noqa: BLE001 (a launch that does not fit is skipped)
            print(f"N {n} K {k} {block_n}/{block_k}/{warps}: {type(e).__name__} {str(e)[:120]}")
    rows.sort(key=lambda r: r["us"])
    return dict(n=n, k=k, cublas_us=cublas, gemv=rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gemv-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every timing here (with the run's date, commit, versions)")
    args = ap.parse_args(argv)
    results: dict = {}
    current = {}
    for name, (n, k) in SHAPES.items():
        res = results[name] = sweep_shape(n, k)
        rows, cublas = res["gemv"], res["cublas_us"]
        launch = tg.gemv_launch(n)
        cur = next(r for r in rows if (r["block_n"], r["block_k"], r["warps"]) == launch)
        current[name] = cur["us"]
        best = rows[0]
        gb = n * k * 2 / 1e6
        print(f"{name:8s} N {n:5d} K {k:5d}: cuBLAS {cublas:6.2f} us ({gb / cublas:.2f} TB/s); GEMV current "
              f"{cur['us']:6.2f} us ({gb / cur['us']:.2f} TB/s); best {best['us']:6.2f} us "
              f"({gb / best['us']:.2f} TB/s) at rows {best['block_n']}, K slice {best['block_k']}, warps "
              f"{best['warps']}; max |diff| to cuBLAS {cur['err']:.3g}", flush=True)
    layer = {"cublas": sum(r["cublas_us"] for r in results.values()), "gemv_current": sum(current.values()),
             "gemv_best": sum(r["gemv"][0]["us"] for r in results.values())}
    print("layer (four GEMMs): " + ", ".join(f"{k} {v:.1f} us" for k, v in layer.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench gemv-sweep", argv, gpu=True), "results": results,
                       "layer": layer}, f)
    return 0
