"""Top-k routing, exactly as HF's Qwen3-MoE router: softmax over all experts in fp32, keep the k largest, and
(with ``norm_topk_prob``) divide them by their sum."""

from __future__ import annotations

from typing import Tuple

import torch


def fused_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
               renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [M, k] fp32, expert ids [M, k] int32); ``hidden_states`` only fixes M (upstream's signature)."""
    assert gating_output.shape[0] == hidden_states.shape[0]
    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def apply_weights_on_input(hidden_states: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale the input by the (single) routing weight instead of the output (``apply_router_weight_on_input``)."""
    assert weights.shape[1] == 1, "routing weights can be applied on the input only with top-1"
    return hidden_states * weights.to(hidden_states.dtype), torch.ones_like(weights)
