"""Every algorithm cuBLASLt's heuristic offers for the decode-batch GEMMs at the Qwen3-0.6B linear shapes, timed
against what F.linear runs (GPU): whether choosing the algorithm per shape beats cuBLAS's own pick.

    python -m bench cublaslt-sweep [--rows 16 64 128 224] [--json out.json]

Each candidate is timed as ``gemm-sweep`` times a GEMM: 56 calls in one CUDA graph cycling through 28 weight
matrices (one per layer, from DRAM as in a decode step), µs per call; the LM head (311 MB of weights, larger than
L2) through two copies. Prints per shape and row count F.linear's time, the heuristic's first candidate, the
fastest candidate with its configuration (algorithm id, tile id, K splits, stages id, cluster id), and the layer
sums. The candidates come from ``bench/csrc/cublaslt_gemm.cpp``, built on first use by torch's extension loader.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import torch

from . import meta
from .gpu_gemv_sweep import LAYERS, SHAPES, graph_us

LM_HEAD = (151936, 1024)
SOURCE = Path(__file__).resolve().parent / "csrc" / "cublaslt_gemm.cpp"
WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on Hopper


def load_cublaslt() -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(name="bench_cublaslt", sources=[str(SOURCE)], extra_cflags=["-O3", "-std=c++17"],
                extra_ldflags=["-lcublasLt"], with_cuda=True, verbose=False)


def time_candidates(module, x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor,
                    workspace: torch.Tensor) -> list[dict]:
    ref = torch.matmul(x, weights[0].t()).float()
    rows = []
    for index in range(module.lt_candidates(x, weights[0], out, workspace)):
        try:
            module.lt_matmul(x, weights[0], out, workspace, index)
            err = (out.float() - ref).abs().max().item()
            us = graph_us(lambda i, c=index: module.lt_matmul(x, weights[i % len(weights)], out, workspace, c),
                          calls=2 * LAYERS)
        except Exception as e:  # noqa: BLE001 (a candidate that fails is reported and skipped)
            print(f"  candidate {index}: {type(e).__name__} {str(e)[:120]}")
            continue
        algo, tile, splits, stages, cluster, ws, waves = module.lt_describe(x, weights[0], out, workspace, index)
        rows.append(dict(index=index, us=us, err=err, algo=algo, tile=tile, splits=splits, stages=stages,
                         cluster=cluster, workspace=ws, waves=waves / 1000))
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cublaslt-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every timing here (with the run's date, commit, versions)")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 224], help="batch rows (M) to time")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the LM head shape")
    args = ap.parse_args(argv)
    module = load_cublaslt()
    dev, dtype = "cuda", torch.bfloat16
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    shapes = {name: (n, k) for name, (n, k, _) in SHAPES.items()}
    if not args.no_lm_head:
        shapes["lm_head"] = LM_HEAD
    results: list[dict] = []
    for name, (n, k) in shapes.items():
        copies = 2 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            out = torch.empty(m, n, device=dev, dtype=dtype)
            linear = graph_us(lambda i, x=x, ws=weights, o=out: torch.matmul(x, ws[i % len(ws)].t(), out=o),
                              calls=2 * LAYERS)
            candidates = time_candidates(module, x, weights, out, workspace)
            first = candidates[0]["us"] if candidates and candidates[0]["index"] == 0 else float("nan")
            best = min(candidates, key=lambda r: r["us"]) if candidates else None
            results.append(dict(shape=name, m=m, n=n, k=k, linear=linear, heuristic_first=first,
                                candidates=candidates))
            if best is None:
                print(f"{name:8s} M {m:4d}: F.linear {linear:7.2f} us, no candidate", flush=True)
                continue
            print(f"{name:8s} M {m:4d} N {n:6d} K {k:5d}: F.linear {linear:7.2f} us, heuristic first {first:7.2f}, "
                  f"best {best['us']:7.2f} (candidate {best['index']} of {len(candidates)}: algo {best['algo']} "
                  f"tile {best['tile']} splits {best['splits']} stages {best['stages']} cluster {best['cluster']}, "
                  f"err {best['err']:.3g})", flush=True)
            del x, out
        del weights
    for m in args.rows:
        rows = [r for r in results if r["m"] == m and r["shape"] != "lm_head" and r["candidates"]]
        print(f"layer at M {m}: F.linear {sum(r['linear'] for r in rows):.1f} us, tuned "
              f"{sum(min(c['us'] for c in r['candidates']) for r in rows):.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench cublaslt-sweep", argv, gpu=True), "results": results},
                      f)
    return 0
