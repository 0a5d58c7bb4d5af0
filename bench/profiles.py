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
    """gemm (the dense weights: GEMMs, GEMVs, the LM head), moe (the experts' grouped GEMMs), attention, other."""
    low = name.lower()
    if "fused_moe" in low:
        return "moe"
    if any(s in low for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")):
        return "gemm"
    if any(s in low for s in ("flashinfer", "batchdecode", "batchprefill", "prefill", "decode_split",
                              "decode_combine", "merge", "attention", "flash")):
        return "attention"
    return "other"


def serial_by_kind(prof, steps: int) -> tuple[dict, float]:
    """Device time per step by kernel kind, each kernel charged from the later of its start and the previous
    kernel's end to its own end, and the idle time between kernels (us per step). A kernel launched early under
    PDL waits inside its own duration for the one before it, so durations overlap and over-count; these charges
    do not, and add up to the device's span."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.end)
    charged: dict = defaultdict(float)
    idle, prev_end = 0.0, None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        if prev_end is not None:
            idle += max(0.0, start - prev_end)
            start = max(start, prev_end)
        charged[kernel_kind(e.name)] += max(0.0, end - start) / steps
        prev_end = end
    return dict(charged), idle / steps


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
    serial, idle = serial_by_kind(prof, steps)
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "by_kind": dict(by_kind), "top": kernels[:25],
            "serial_us": serial, "idle_us": idle,
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
