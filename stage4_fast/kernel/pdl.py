"""Programmatic dependent launch (PDL, sm_90+) for the Triton kernels: a kernel may start while the one before it
runs, reading only what no running kernel writes (weights) until ``pdl_wait``; right after its wait it lets the
next one launch, so at most two kernels overlap. After a kernel that never signals (cuBLAS, torch) the stream
order is unchanged. Off under Triton's interpreter."""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import torch
import triton
import triton.language as tl

from . import triton_interpreting


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch (no-ops without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _enabled(device_index: int) -> bool:
    return not triton_interpreting() and _capable(device_index)


def pdl_launch(device: torch.device) -> Tuple[bool, Dict[str, Any]]:
    """(the kernels' PDL flag, the extra launch options) for a launch on ``device``."""
    on = device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())
    return (True, {"launch_pdl": True}) if on else (False, {})
