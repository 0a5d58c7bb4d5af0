"""Fused MoE backend: the Triton grouped GEMM (``kernel/triton_moe.py``), two launches for all experts."""

from __future__ import annotations

import torch

from .base import BaseMoeBackend
from .topk import apply_weights_on_input, fused_topk


class FusedMoe(BaseMoeBackend):
    def __init__(self) -> None:
        from ..kernel.triton_moe import fused_experts  # Triton is needed only when this backend is used

        self._fused_experts = fused_experts

    def forward(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        gating_output: torch.Tensor,
        topk: int,
        renormalize: bool,
        activation: str,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        weights, ids = fused_topk(hidden_states, gating_output, topk, renormalize)
        if apply_router_weight_on_input:
            hidden_states, weights = apply_weights_on_input(hidden_states, weights)
        return self._fused_experts(hidden_states, w1, w2, weights, ids, activation)
