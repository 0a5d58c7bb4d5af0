"""Host time per launch of a prefill step's pieces at 16,384 and 8,192 rows (the device kept busy, so no launch waits):
torch.nn.functional.linear through cuBLASLt and cuBLAS, two Triton kernels of stage4, torch.empty and an add.

    python bench/results/raw/h200-served-host-launch-cost.py   # on a CUDA GPU, in the repository root
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from stage4_fast.kernel import triton_fused

DEVICE = "cuda"
BF16 = dict(device=DEVICE, dtype=torch.bfloat16)
LINEARS = {"qkv": (1024, 4096), "gate_up": (1024, 6144), "down": (3072, 1024), "o": (2048, 1024)}  # (in, out)


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Best of 5: host microseconds per call, with ~10 ms of device work queued ahead so no launch waits."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    busy = torch.empty(1 << 28, device=DEVICE, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        for _ in range(20):
            busy.add_(1)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def report(rows: int) -> None:
    x = torch.randn(rows, 1024, **BF16)
    for name, (k, n) in LINEARS.items():
        xin, w = (x if k == 1024 else torch.randn(rows, k, **BF16)), torch.randn(n, k, **BF16)
        res = {}
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            res[lib] = host_us(lambda xin=xin, w=w: torch.nn.functional.linear(xin, w))
        print(f"linear M={rows} {name}: host us/call " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    res_in, weight = torch.randn(rows, 1024, **BF16), torch.ones(1024, **BF16)
    gate_up = torch.randn(rows, 6144, **BF16)
    print(f"M={rows} add_rmsnorm host us {host_us(lambda: triton_fused.add_rmsnorm(x, res_in, weight, 1e-6)):.1f}")
    print(f"M={rows} silu_and_mul host us {host_us(lambda: triton_fused.silu_and_mul(gate_up)):.1f}")
    print(f"M={rows} torch.empty host us {host_us(lambda: torch.empty(rows, 1024, **BF16)):.1f}")
    print(f"M={rows} torch add host us {host_us(lambda: x + res_in):.1f}")


if __name__ == "__main__":
    for rows in (16384, 8192):
        report(rows)
