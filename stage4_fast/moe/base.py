from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseMoeBackend(ABC):
    @abstractmethod
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
        """hidden [M, H], w1 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], router logits [M, E] -> [M, H]:
        this rank's partial sum when the experts' intermediate dim is sharded (the caller all-reduces)."""
