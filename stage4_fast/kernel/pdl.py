"""Programmatic dependent launch (PDL, Hopper and later) for the engine's Triton kernels.

A decode step is a chain of a few hundred small dependent kernels; inside a CUDA graph each boundary still costs
the next kernel's launch and ramp. Launched with PDL a kernel may start while the one before it still runs: its
programs wait with ``griddepcontrol.wait`` (``pdl_wait``) before they read anything that kernel wrote, and
meanwhile may read what no earlier kernel writes (a GEMV's weights). Right after its wait a kernel lets the next
one launch (``griddepcontrol.launch_dependents``), so at most two kernels overlap and the second reads only
constants until its wait (or rows written before the kernel before it started: the deferred norms', ``triton_fused``).

A kernel launched without PDL, or after one that never signals (cuBLAS, torch), starts when the previous kernel
ends: the stream's order is unchanged. Triton's interpreter and GPUs before compute capability 9.0 never use it.
The answer is worked out once per device, since every eager Triton launch asks.
"""

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


_OFF: Tuple[bool, Dict[str, Any]] = (False, {})
_ON: Tuple[bool, Dict[str, Any]] = (True, {"launch_pdl": True})


def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _enabled(device_index: int) -> bool:
    return not triton_interpreting() and _capable(device_index)


def pdl_launch(device: torch.device) -> Tuple[bool, Dict[str, Any]]:
    """(the kernels' PDL flag, the extra launch options) for a launch on ``device``."""
    if device.type != "cuda":
        return _OFF
    return _ON if _enabled(device.index if device.index is not None else torch.cuda.current_device()) else _OFF
