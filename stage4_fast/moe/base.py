from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Tuple

import torch

from ..kernel.ref import fused_experts_ref
from .topk import apply_weights_on_input, fused_topk


class BaseMoeBackend(ABC):
    """A backend says how the chosen experts run (`experts`); routing is HF's top-k in torch unless it has a kernel
    for it (`route`)."""

    def forward(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gating_output: torch.Tensor,
                topk: int, renormalize: bool, activation: str, apply_router_weight_on_input: bool) -> torch.Tensor:
        """hidden [M, H], w1 [E, 2I, H] (gate, then up), w2 [E, H, I], router logits [M, E] -> [M, H] (this rank's
        partial sum under TP; the caller all-reduces)."""
        weights, ids = self.route(hidden_states, gating_output, topk, renormalize)
        if apply_router_weight_on_input:
            hidden_states, weights = apply_weights_on_input(hidden_states, weights)
        return self.experts(hidden_states, w1, w2, weights, ids, activation)

    def route(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
              renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        return fused_topk(hidden_states, gating_output, topk, renormalize)

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
    """The Triton grouped GEMM (``kernel/triton_moe.py``): two launches for all experts. With ``few_token_path``
    the routing is one kernel and up to 4 tokens (decode of a few requests) the (token, expert) pairs skip the sort
    by expert: at one token each is ~25 small kernels per layer, more than the experts' bytes take to read. Without
    it (``--moe-backend fused_sorted``, the ablation) routing is torch's ops and the pairs are always sorted."""

    def __init__(self, few_token_path: bool = True) -> None:
        from ..kernel import triton_moe  # Triton is needed only when this backend is used

        self._topk_softmax = triton_moe.topk_softmax if few_token_path else None
        unsorted_max_tokens = 4 if few_token_path else 0
        self._fused_experts = functools.partial(triton_moe.fused_experts, unsorted_max_tokens=unsorted_max_tokens)

    def route(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
              renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._topk_softmax is None:
            return super().route(hidden_states, gating_output, topk, renormalize)
        return self._topk_softmax(gating_output, topk, renormalize)

    def experts(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        return self._fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation)
