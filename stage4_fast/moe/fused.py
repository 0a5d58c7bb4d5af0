"""Fused MoE backend: the Triton grouped GEMM (``kernel/triton_moe.py``), two launches for all experts."""

from __future__ import annotations

import torch

from .base import BaseMoeBackend


class FusedMoe(BaseMoeBackend):
    def __init__(self) -> None:
        from ..kernel.triton_moe import fused_experts  # Triton is needed only when this backend is used

        self._fused_experts = fused_experts

    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        return self._fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation)
