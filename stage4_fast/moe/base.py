from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..kernel.ref import fused_experts_ref
from .topk import apply_weights_on_input, fused_topk


class BaseMoeBackend(ABC):
    """Routing is shared (top-k as HF); a backend only says how the chosen experts run (`experts`)."""

    def forward(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gating_output: torch.Tensor,
                topk: int, renormalize: bool, activation: str, apply_router_weight_on_input: bool) -> torch.Tensor:
        """hidden [M, H], w1 [E, 2I, H] (gate, then up), w2 [E, H, I], router logits [M, E] -> [M, H] (this rank's
        partial sum under TP; the caller all-reduces)."""
        weights, ids = fused_topk(hidden_states, gating_output, topk, renormalize)
        if apply_router_weight_on_input:
            hidden_states, weights = apply_weights_on_input(hidden_states, weights)
        return self.experts(hidden_states, w1, w2, weights, ids, activation)

    @abstractmethod
    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        """Each token through its top-k experts ([M, k] ids and weights), weighted and summed -> [M, H]."""


class TorchMoe(BaseMoeBackend):
    """Reference: one plain GEMM pair per expert that received tokens (as HF does)."""

    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        return fused_experts_ref(hidden_states, w1, w2, topk_weights, topk_ids, activation)


class FusedMoe(BaseMoeBackend):
    """The Triton grouped GEMM (``kernel/triton_moe.py``): two launches for all experts."""

    def __init__(self) -> None:
        from ..kernel.triton_moe import fused_experts  # Triton is needed only when this backend is used

        self._fused_experts = fused_experts

    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        return self._fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation)
