"""Reference MoE backend: one plain GEMM pair per expert that received tokens (as HF does)."""

from __future__ import annotations

import torch

from ..kernel.ref import fused_experts_ref
from .base import BaseMoeBackend


class TorchMoe(BaseMoeBackend):
    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        return fused_experts_ref(hidden_states, w1, w2, topk_weights, topk_ids, activation)
