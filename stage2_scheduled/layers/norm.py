from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from .base import BaseOP


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; on CPU it gives the same bits as HF's formula below
        return F.rms_norm(x, weight.shape, weight, eps)
    # HF's op order (normalise in fp32, cast back, then scale), which decides the rounding in bf16/fp16
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(BaseOP):
    def __init__(self, size: int, eps: float):
        self.eps = eps
        self.weight = torch.empty(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RMSNormFused(RMSNorm):
    """RMSNorm with the residual add folded in: returns (norm(x + residual), x + residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        residual.add_(x)  # the residual stream is ours (embedding output or an earlier sum): update it in place
        return rms_norm(residual, self.weight, self.eps), residual
