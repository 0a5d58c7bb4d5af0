"""A decode batch's qkv projection with its q/k norm, RoPE and fp8 K/V store: cuBLAS's GEMM followed by the q/k
kernel (``triton_fused.qk_norm_rope`` with the deferred norm's row scale), against the one kernel that does both
(``kernel/triton_qkv.py``) over its launch grid (GPU), at the Qwen3-0.6B shape.

    python -m bench qkv-sweep [--rows 16 64 128 224] [--json out.json]

Each variant is timed as 56 calls in one CUDA graph cycling through 28 weight matrices (one per layer, cold as in a
decode step), in us per call, with programmatic dependent launch off (a chain of the same kernel would overlap in a
way no decode step does). Every launch's q, k, v and pool rows are checked against the two-kernel path's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from . import meta
from .gpu_gemv_sweep import LAYERS, graph_us

HIDDEN, HQ, HKV, D = 1024, 16, 8, 128
GRID = {"block_m": [16, 32, 64], "block_k": [64, 128], "warps": [4, 8], "stages": [3, 4]}


def _setup(rows: int, dev: str = "cuda"):
    from stage4_fast.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=dev).manual_seed(rows)
    weights = [torch.randn((HQ + 2 * HKV) * D, HIDDEN, device=dev, generator=gen, dtype=torch.bfloat16)
               * HIDDEN**-0.5 for _ in range(LAYERS)]
    hidden = torch.randn(rows, HIDDEN, device=dev, generator=gen, dtype=torch.bfloat16) * 3
    qw = torch.rand(D, device=dev, generator=gen, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(D, device=dev, generator=gen, dtype=torch.bfloat16) + 0.5
    rope = RotaryEmbedding(D, D, 40960, 1e6, device=dev)
    positions = torch.randint(0, 2048, (rows,), device=dev, generator=gen, dtype=torch.int32)
    slots = 4 * rows
    out_loc = torch.randperm(slots, device=dev, generator=gen)[:rows].to(torch.int32)
    pool = [torch.zeros(slots, HKV, D, device=dev, dtype=torch.float8_e4m3fn) for _ in range(2)]
    return weights, hidden, qw, kw, rope, positions, out_loc, pool


def sweep_rows(rows: int, grid: dict) -> dict:
    from stage4_fast.kernel import triton_fused, triton_qkv

    weights, hidden, qw, kw, rope, positions, out_loc, (k_cache, v_cache) = _setup(rows)
    store = (k_cache, v_cache, out_loc)

    def two_kernels(i: int):
        qkv = torch.matmul(hidden, weights[i % LAYERS].t())
        q, k = triton_fused.qk_norm_rope(qkv, HQ, HKV, D, qw, kw, 1e-6, rope.cos_sin_cache, positions, store,
                                         row_scale=(hidden, 1e-6))
        return q, k, qkv[:, (HQ + HKV) * D:].view(rows, HKV, D)

    def fused(i: int, launch=None):
        return triton_qkv.qkv_norm_rope(hidden, weights[i % LAYERS], HQ, HKV, D, qw, kw, 1e-6, 1e-6,
                                        rope.cos_sin_cache, positions, store, launch=launch)

    ref = [t.float().clone() for t in two_kernels(0)]
    ref_pool = (k_cache[out_loc.long()].float().clone(), v_cache[out_loc.long()].float().clone())
    base_us = graph_us(two_kernels, calls=2 * LAYERS)
    result = {"rows": rows, "two_kernels_us": base_us, "launches": []}
    default = triton_qkv._block_m(rows), triton_qkv.BLOCK_K, 4, 3
    for launch in [default] + (list(itertools.product(*grid.values())) if grid else []):
        if launch[0] > max(16, 2 * rows) and launch != default:
            continue  # programs of mostly masked rows
        try:
            k_cache.zero_()
            v_cache.zero_()
            out = fused(0, launch)
            diff = max(((o.float() - r).abs().max() / r.abs().mean()).item() for o, r in zip(out, ref))
            pool = (k_cache[out_loc.long()].float(), v_cache[out_loc.long()].float())
            pool_diff = max(((p - r).abs().max() / r.abs().mean()).item() for p, r in zip(pool, ref_pool))
            us = graph_us(lambda i, launch=launch: fused(i, launch), calls=2 * LAYERS)
        except Exception as exc:  # noqa: BLE001 (a launch that does not fit: shared memory, registers)
            result["launches"].append({"launch": launch, "error": str(exc).splitlines()[0][:200]})
            continue
        result["launches"].append({"launch": launch, "us": us, "max_rel_diff": diff, "pool_max_rel_diff": pool_diff})
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench qkv-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 96, 128, 160, 192, 224, 256])
    ap.add_argument("--quick", action="store_true", help="only the engine's default launch")
    ap.add_argument("--json", help="write every launch's figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("qkv-sweep needs a CUDA GPU")
        return 2
    os.environ["MINISGL_DISABLE_PDL"] = "1"
    grid = {} if args.quick else GRID
    results = []
    print(f"{'rows':>5} {'GEMM + q/k kernel':>18} {'fused (default)':>16} {'fused (best)':>13}  best launch")
    for rows in args.rows:
        r = sweep_rows(rows, grid)
        timed = [x for x in r["launches"] if "us" in x]
        if not timed:
            print(f"{rows:>5} {r['two_kernels_us']:>18.2f}  no launch ran: {r['launches'][0].get('error')}")
            results.append(r)
            continue
        best = min(timed, key=lambda x: x["us"])
        print(f"{rows:>5} {r['two_kernels_us']:>18.2f} {timed[0]['us']:>16.2f} {best['us']:>13.2f}  "
              f"{best['launch']} (max rel diff {max(x['max_rel_diff'] for x in timed):.4f})", flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench qkv-sweep", argv, gpu=True), "results": results}, f)
    return 0
