from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x holds [gate | up] halves (the merged gate_up projection); returns silu(gate) * up."""
    d = x.shape[-1] // 2
    return torch.mul(F.silu(x[..., :d]), x[..., d:], out=out)
