"""The split-K GEMM candidate of ``python -m bench gemm-sweep`` under Triton's interpreter (CPU): right values,
the same bits on every call, and its tile counters back at zero (the next call, or a graph replay, relies on it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import torch
from bench.gpu_gemm_sweep import GemmLaunch, _tile_counters, gemm, launch_applies
torch.manual_seed(0)
# fp16: the interpreter's bf16 dot is not exact (it has no bf16 numpy type); the GPU runs bf16
for m, n, k, launch in [(5, 96, 128, GemmLaunch(16, 32, 32, 2, 4, 2)), (33, 72, 256, GemmLaunch(32, 32, 64, 4, 4, 2)),
                        (7, 40, 64, GemmLaunch(16, 16, 64, 1, 4, 2))]:
    assert launch_applies(m, n, k, launch)
    x, w = torch.randn(m, k, dtype=torch.float16), torch.randn(n, k, dtype=torch.float16)
    y = gemm(x, w, launch)
    ref = x.float() @ w.float().t()
    assert (y.float() - ref).abs().max().item() <= 2e-3 * ref.abs().max().item() + 1e-2, (m, n, k)
    assert torch.equal(gemm(x, w, launch), y)
    assert int(_tile_counters(x.device).abs().sum()) == 0
assert not launch_applies(8, 64, 96, GemmLaunch(16, 32, 64, 2, 4, 2))  # K must split into whole blocks
print("ok")
"""


def test_splitk_gemm_candidate_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
