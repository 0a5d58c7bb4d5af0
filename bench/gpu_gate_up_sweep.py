"""A decode batch's gate_up projection with the deferred norm and SiLU-and-mul: cuBLAS's GEMM followed by the
SiLU-and-mul kernel (``triton_fused.silu_and_mul`` with the row scale), against the one kernel that does both
(``kernel/triton_gate_up.py``) over its launch grid (GPU), at the Qwen3-0.6B shape.

    python -m bench gate-up-sweep [--rows 16 64 128 224] [--quick] [--json out.json]

Each variant is timed as 56 calls in one CUDA graph cycling through 28 weight matrices (one per layer, cold as in a
decode step), in us per call, with programmatic dependent launch off (a chain of the same kernel would overlap in a
way no decode step does). Every launch's output is checked against the two-kernel path's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from . import meta
from .gpu_gemv_sweep import LAYERS, graph_us

HIDDEN, INTER = 1024, 3072
GRID = {"block_m": [16, 32, 64, 128], "block_n": [32, 64, 128], "block_k": [64, 128], "warps": [4, 8],
        "stages": [3, 4]}


def sweep_rows(rows: int, grid: dict) -> dict:
    from stage4_fast.kernel import triton_fused, triton_gate_up

    gen = torch.Generator(device="cuda").manual_seed(rows)
    weights = [torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * HIDDEN**-0.5
               for _ in range(LAYERS)]
    hidden = torch.randn(rows, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 3

    def two_kernels(i: int) -> torch.Tensor:
        return triton_fused.silu_and_mul(torch.matmul(hidden, weights[i % LAYERS].t()), row_scale=(hidden, 1e-6))

    def fused(i: int, launch=None) -> torch.Tensor:
        return triton_gate_up.gate_up_silu(hidden, weights[i % LAYERS], 1e-6, launch=launch)

    ref = two_kernels(0).float()
    result = {"rows": rows, "two_kernels_us": graph_us(two_kernels, calls=2 * LAYERS),
              "gemm_alone_us": graph_us(lambda i: torch.matmul(hidden, weights[i % LAYERS].t()), calls=2 * LAYERS),
              "launches": []}
    default = triton_gate_up.default_launch(rows, HIDDEN)
    for launch in [default] + (list(itertools.product(*grid.values())) if grid else []):
        if launch != default and (launch[0] > max(16, 2 * rows) or launch[0] * launch[1] > 128 * 64):
            continue  # programs of mostly masked rows; accumulators that spill
        try:
            diff = ((fused(0, launch).float() - ref).abs().max() / ref.abs().mean()).item()
            us = graph_us(lambda i, launch=launch: fused(i, launch), calls=2 * LAYERS)
        except Exception as exc:  # noqa: BLE001 (a launch that does not fit: shared memory, registers)
            result["launches"].append({"launch": launch, "error": str(exc).splitlines()[0][:200]})
            continue
        result["launches"].append({"launch": launch, "us": us, "max_rel_diff": diff})
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gate-up-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 160, 192, 224, 256])
    ap.add_argument("--quick", action="store_true", help="only the engine's default launch")
    ap.add_argument("--json", help="write every launch's figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gate-up-sweep needs a CUDA GPU")
        return 2
    os.environ["MINISGL_DISABLE_PDL"] = "1"
    grid = {} if args.quick else GRID
    results = []
    print(f"{'rows':>5} {'GEMM alone':>10} {'GEMM + SiLU kernel':>19} {'fused (default)':>16} {'fused (best)':>13}"
          "  best launch")
    for rows in args.rows:
        r = sweep_rows(rows, grid)
        results.append(r)
        timed = [x for x in r["launches"] if "us" in x]
        if not timed:
            print(f"{rows:>5} {r['two_kernels_us']:>30.2f}  no launch ran: {r['launches'][0].get('error')}")
            continue
        best = min(timed, key=lambda x: x["us"])
        print(f"{rows:>5} {r['gemm_alone_us']:>10.2f} {r['two_kernels_us']:>19.2f} {timed[0]['us']:>16.2f} "
              f"{best['us']:>13.2f}  {best['launch']} (max rel diff {max(x['max_rel_diff'] for x in timed):.4f})",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench gate-up-sweep", argv, gpu=True), "results": results}, f)
    return 0
