"""Host time of a GEMM (and of two Triton kernels) at a row count the process has not run before, against a repeat.

    PYTHONPATH=. python bench/results/raw/h100-gemm-first-calls-new-m.py OUT.json   # on a CUDA GPU, repository root
"""

import json
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from stage4_fast.kernel.triton_fused import add_rmsnorm, silu_and_mul

DEV = "cuda"
# the 0.6B shape's projections (out, in) and the burst model's LM head
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "lm": (49152, 1024)}


def host_us(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(dt * 1e6, 1)


def main(path: str) -> None:
    w = {k: torch.randn(n, kk, device=DEV, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    x = {k: torch.randn(16384, kk, device=DEV, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    out: dict[str, list[dict]] = {"linear": [], "addmm": [], "triton": [], "linear_lt": []}
    for m in [8192, 8192, 7301, 7301, 3943, 3943, 7302, 7300, 7299, 4000, 4001, 11753, 11753, 508, 508, 16, 17, 31]:
        row: dict = {"M": m}
        for k in SHAPES:
            if k != "lm" or m <= 64:
                row[k] = host_us(lambda k=k, m=m: F.linear(x[k][:m], w[k]))
        out["linear"].append(row)
        print(row, flush=True)
    for m in [5555, 5555, 6666, 6666]:  # the o and down projections add into the residual (beta = 1)
        res = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
        row = {"M": m, "o_addmm": host_us(lambda res=res, m=m: res.addmm_(x["o"][:m], w["o"].t())),
               "down_addmm": host_us(lambda res=res, m=m: res.addmm_(x["down"][:m], w["down"].t()))}
        out["addmm"].append(row)
        print(row, flush=True)
    act = torch.randn(16384, 6144, device=DEV, dtype=torch.bfloat16)
    hid = torch.randn(16384, 1024, device=DEV, dtype=torch.bfloat16)
    norm_w = torch.randn(1024, device=DEV, dtype=torch.bfloat16)
    for m in [8192, 8192, 7301, 7301, 3943, 3943, 9999]:
        row = {"M": m, "silu": host_us(lambda m=m: silu_and_mul(act[:m])),
               "rmsnorm": host_us(lambda m=m: add_rmsnorm(hid[:m].clone(), None, norm_w, 1e-6))}
        out["triton"].append(row)
        print(row, flush=True)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for m in [8192, 8192, 6543, 6543, 2345, 2345]:
        row = {"M": m, **{k: host_us(lambda k=k, m=m: F.linear(x[k][:m], w[k])) for k in ("qkv", "gate_up")}}
        out["linear_lt"].append(row)
        print("lt", row, flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
