"""Per-request state of a hybrid model's linear-attention layers: the last K-1 conv inputs (``conv_state``) and the
delta-rule memory (``ssm_state``, fp32 as HF and FLA: bf16 would drift), rewritten in place every step, so neither
paged nor shared. One slot per request slot plus the dummy's; a first prefill starts from zeros."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..models import ModelConfig


class LinearStatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, dtype: torch.dtype, device: torch.device,
                 ssm_dtype: torch.dtype = torch.float32):
        self.num_layers = num_layers  # linear-attention layers only
        self.num_slots = num_slots
        # zeros, not empty: the dummy slot is read by padding rows before anything was written to it
        self._conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self._ssm = torch.zeros(num_layers, num_slots, num_v_heads, head_k_dim, head_v_dim, dtype=ssm_dtype,
                                device=device)

    def conv_state(self, layer: int) -> torch.Tensor:
        return self._conv[layer]  # [num_slots, conv_dim, K-1], a view: writes go to the pool

    def ssm_state(self, layer: int) -> torch.Tensor:
        return self._ssm[layer]  # [num_slots, v_heads, Dk, Dv], a view

    @property
    def device(self) -> torch.device:
        return self._ssm.device


def create_state_pool(model_config: ModelConfig, num_slots: int, dtype: torch.dtype,
                      device: torch.device) -> LinearStatePool:
    lin = model_config.linear_attn
    assert lin is not None, "not a hybrid model"
    return LinearStatePool(lin.num_linear_layers, num_slots, lin.conv_dim, lin.conv_kernel, lin.num_v_heads,
                           lin.head_k_dim, lin.head_v_dim, dtype, device)
