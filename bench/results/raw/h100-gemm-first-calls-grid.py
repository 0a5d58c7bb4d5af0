"""cuBLAS's first-call host time at 40 random row counts after warming every STEP-th row count (0: none).

    python bench/results/raw/h100-gemm-first-calls-grid.py STEP   # on a CUDA GPU; prints one JSON line
"""

import json
import random
import sys
import time

import torch
import torch.nn.functional as F

TOP = 8192
DEV = "cuda"
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def main(step: int) -> None:
    w = {k: torch.randn(n, kk, device=DEV, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    x = {k: torch.randn(TOP, kk, device=DEV, dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
    residual = torch.zeros(TOP, 1024, device=DEV, dtype=torch.bfloat16)

    def projections(m: int) -> None:  # as a dense layer runs them: o and down add into the residual
        F.linear(x["qkv"][:m], w["qkv"])
        F.linear(x["gate_up"][:m], w["gate_up"])
        residual[:m].addmm_(x["o"][:m], w["o"].t())
        residual[:m].addmm_(x["down"][:m], w["down"].t())

    torch.cuda.synchronize()
    t = time.perf_counter()
    if step > 0:
        for m in range(step, TOP + 1, step):
            projections(m)
        for m in range(1, min(step, 64)):
            projections(m)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    rng = random.Random(1)
    costs = []
    for m in [rng.randint(2, TOP) for _ in range(40)]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        projections(m)
        costs.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    t = time.perf_counter()
    projections(5000)
    once_more = (time.perf_counter() - t) * 1e3
    print(json.dumps({"step": step, "warm_s": warm_s, "mean_ms": sum(costs) / len(costs), "max_ms": max(costs),
                      "over_1ms": sum(c > 1 for c in costs), "repeat_ms": once_more,
                      "costs": [round(c, 2) for c in costs]}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
