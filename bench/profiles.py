"""The profiles of `python -m bench breakdown` summarised: kernels per step by kind (torch.profiler) and the
host's Python functions per scheduler loop (cProfile)."""

from __future__ import annotations

import cProfile
import pstats
from collections import defaultdict
from pathlib import Path

import torch


def _self_device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def kernel_kind(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")):
        return "gemm"
    if any(s in low for s in ("flashinfer", "batchdecode", "batchprefill", "prefill", "decode_split", "merge",
                              "attention", "flash")):
        return "attention"
    return "other"


def summarize_profile(prof, steps: int, wall: float) -> dict:
    kernels = []
    for evt in prof.key_averages():
        us = _self_device_us(evt)
        if us <= 0 or getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # host ops: their kernels are listed themselves
        kernels.append({"name": evt.key, "kind": kernel_kind(evt.key), "us_per_step": us / steps,
                        "calls_per_step": evt.count / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    by_kind: dict = defaultdict(lambda: {"us_per_step": 0.0, "calls_per_step": 0.0})
    for k in kernels:
        by_kind[k["kind"]]["us_per_step"] += k["us_per_step"]
        by_kind[k["kind"]]["calls_per_step"] += k["calls_per_step"]
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "by_kind": dict(by_kind), "top": kernels[:25],
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels)}


def summarize_host_profile(prof: cProfile.Profile, loops: int, top: int = 30) -> dict:
    """cProfile's functions by their own time per scheduler loop (and with what they call), the largest first."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line} {name}"
        rows.append({"function": where, "calls_per_loop": calls / loops, "own_us_per_loop": 1e6 * own / loops,
                     "cum_us_per_loop": 1e6 * cum / loops})
    total = sum(r["own_us_per_loop"] for r in rows)
    by_own = sorted(rows, key=lambda r: -r["own_us_per_loop"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_us_per_loop"])[:top]
    return {"loops": loops, "own_us_per_loop_total": total, "top_own": by_own, "top_cumulative": by_cum}


def report_host_profile(name: str, hp: dict) -> str:
    lines = [f"== {name}: cProfile over {hp['loops']} scheduler loops at mean bs {hp['mean_bs']:.0f}: "
             f"{hp['own_us_per_loop_total'] / 1e3:.2f} ms of Python per loop (profiler on)",
             "   own time:"]
    lines += [f"      {r['own_us_per_loop']:8.1f} us/loop {r['calls_per_loop']:7.1f}x  {r['function'][:100]}"
              for r in hp["top_own"][:20]]
    lines.append("   with callees:")
    lines += [f"      {r['cum_us_per_loop']:8.1f} us/loop {r['calls_per_loop']:7.1f}x  {r['function'][:100]}"
              for r in hp["top_cumulative"][:20]]
    return "\n".join(lines)
