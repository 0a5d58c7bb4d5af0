from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernel import fused_kernels_for
from .norm import scale_by_rms_of


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x holds [gate | up] halves (the merged gate_up projection); returns silu(gate) * up. ``row_scale`` =
    (hidden, eps): x projects unnormalised rows, first scaled by RMSNorm's factor of ``hidden`` (models/decoder.py)."""
    if out is None and x.dim() == 2 and x.stride(-1) == 1 and (fused := fused_kernels_for(x)) is not None:
        return fused.silu_and_mul(x, row_scale)  # 16-bit on a GPU: one kernel
    if row_scale is not None:
        x = scale_by_rms_of(x, *row_scale)
    d = x.shape[-1] // 2
    return torch.mul(F.silu(x[..., :d]), x[..., d:], out=out)
