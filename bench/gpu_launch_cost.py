"""What launching a prefill step's kernels costs the host (GPU): µs of Python per call, device work aside.

    python -m bench launch-cost [--rows 16 8192] [--calls 200] [--json out.json]

A prefill step runs eagerly (CUDA graphs cover decode only), so the host launches every kernel of every layer: at
the Qwen3-0.6B shape four GEMMs (F.linear), two add-RMSNorms, the q/k norm + RoPE (+ K/V store) and SiLU-and-mul
(stage4's Triton kernels) and the attention, 28 times. When that launch loop takes longer than the device needs for
the step, the step runs at the host's pace (`bench/gpu_notes.md` sections 13-14, 20). Each launch here is called
``--calls`` times without waiting for the device (small enough that the launch queue never fills) and timed on the
host; ``empty Triton kernel`` is Triton's own floor (one pointer argument, no work), ``torch.empty`` an output
allocation, ``layer`` the sum of one layer's launches.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F
import triton

from . import meta

HIDDEN, INTER, HEAD_DIM, QO_HEADS, KV_HEADS = 1024, 3072, 128, 16, 8


@triton.jit
def _empty_kernel(X):
    pass


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Host µs per call of ``fn``, the device's work not waited for (the queue drained before and after)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def launches(rows: int, dev: str = "cuda") -> Dict[str, Callable[[], object]]:
    """One prefill layer's launches at ``rows`` tokens (one sequence), with random bf16 inputs and an fp8 pool."""
    from stage4_fast.kernel import triton_attention, triton_fused

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    x, residual, norm_w, head_w = rand(rows, HIDDEN), rand(rows, HIDDEN), rand(HIDDEN), rand(HEAD_DIM)
    qkv, gate_up, attn = rand(rows, (QO_HEADS + 2 * KV_HEADS) * HEAD_DIM), rand(rows, 2 * INTER), rand(rows, 2048)
    act = rand(rows, INTER)
    w_qkv, w_o, w_gu, w_down = rand(4096, HIDDEN), rand(HIDDEN, 2048), rand(2 * INTER, HIDDEN), rand(HIDDEN, INTER)
    cos_sin = torch.randn(40960, HEAD_DIM, device=dev)
    positions = torch.arange(rows, device=dev, dtype=torch.int32)
    k_pool = torch.zeros(rows, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.float8_e4m3fn)
    v_pool = torch.zeros_like(k_pool)
    out_loc = torch.arange(rows, device=dev, dtype=torch.int64)
    q = rand(rows, QO_HEADS, HEAD_DIM)
    page_table = torch.arange(rows, device=dev, dtype=torch.int32)[None]
    table_idx = torch.zeros(1, device=dev, dtype=torch.int32)
    cu_seqlens = torch.tensor([0, rows], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([rows], device=dev, dtype=torch.int32)
    return {
        "empty Triton kernel": lambda: _empty_kernel[(1,)](x),
        "torch.empty": lambda: torch.empty(rows, HIDDEN, device=dev, dtype=torch.bfloat16),
        "add_rmsnorm (input)": lambda: triton_fused.add_rmsnorm(x, residual, norm_w, 1e-6),
        "qkv F.linear": lambda: F.linear(x, w_qkv),
        "qk_norm_rope + fp8 store": lambda: triton_fused.qk_norm_rope(
            qkv, QO_HEADS, KV_HEADS, HEAD_DIM, head_w, head_w, 1e-6, cos_sin, positions, (k_pool, v_pool, out_loc)),
        "prefill_attention": lambda: triton_attention.prefill_attention(
            q, k_pool, v_pool, page_table, table_idx, cu_seqlens, seq_lens, rows, HEAD_DIM**-0.5),
        "o F.linear": lambda: F.linear(attn, w_o),
        "add_rmsnorm (after attention)": lambda: triton_fused.add_rmsnorm(x, residual, norm_w, 1e-6),
        "gate_up F.linear": lambda: F.linear(x, w_gu),
        "silu_and_mul": lambda: triton_fused.silu_and_mul(gate_up),
        "down F.linear": lambda: F.linear(act, w_down),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench launch-cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 8192], help="prefill tokens per step")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results: Dict[str, Dict[str, float]] = {}
    for rows in args.rows:
        per_call = {name: host_us(fn, args.calls) for name, fn in launches(rows).items()}
        layer = sum(us for name, us in per_call.items() if name not in ("empty Triton kernel", "torch.empty"))
        per_call["layer"] = layer
        results[str(rows)] = per_call
        print(f"rows {rows}: host µs per call")
        for name, us in per_call.items():
            print(f"  {name:30s} {us:7.1f}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench launch-cost", argv, gpu=True),
                                         "results": results}, indent=1))
    return 0
