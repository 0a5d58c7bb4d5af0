from __future__ import annotations

import torch

from ..core import get_global_ctx
from ..distributed import DistributedCommunicator, get_tp_info
from ..utils import div_even
from .base import BaseOP


class MoELayer(BaseOP):
    """The experts of one sparse MLP, stacked: ``gate_up_proj`` [E, 2 * I/tp, H] and ``down_proj`` [E, H, I/tp];
    TP splits every expert's intermediate dim, so one all-reduce sums the ranks' partial outputs."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, activation: str = "silu", apply_router_weight_on_input: bool = False):
        tp = get_tp_info().size
        local_i = div_even(intermediate_size, tp)
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.activation = activation
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.gate_up_proj = torch.empty(num_experts, 2 * local_i, hidden_size)
        self.down_proj = torch.empty(num_experts, hidden_size, local_i)
        self._tp_size = tp
        self._comm = DistributedCommunicator()

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = get_global_ctx().moe_backend.forward(hidden_states, self.gate_up_proj, self.down_proj, router_logits,
                                                   self.top_k, self.renormalize, self.activation,
                                                   self.apply_router_weight_on_input)
        return self._comm.all_reduce(out) if self._tp_size > 1 else out
