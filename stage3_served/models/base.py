from __future__ import annotations

from abc import abstractmethod

import torch

from ..layers import BaseOP


class BaseLLMModel(BaseOP):  # BaseOP is already an ABC
    @abstractmethod
    def forward(self) -> torch.Tensor:
        """Reads the current batch from the global context; returns logits [rows, vocab] (a row per request)."""
