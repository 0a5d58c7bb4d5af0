"""Reference MoE backend: one plain GEMM pair per expert that received tokens (as HF does)."""

from __future__ import annotations

import torch

from ..kernel.ref import fused_experts_ref
from .base import BaseMoeBackend
from .topk import apply_weights_on_input, fused_topk


class TorchMoe(BaseMoeBackend):
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
        return fused_experts_ref(hidden_states, w1, w2, weights, ids, activation)
