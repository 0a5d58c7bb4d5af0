"""Blocks shared by the decoder architectures."""

from __future__ import annotations

import torch

from ..layers import (
    AttentionLayer,
    BaseOP,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearRowParallel,
    RMSNorm,
    silu_and_mul,
)
from .config import ModelConfig


class GatedMLP(BaseOP):
    def __init__(self, config: ModelConfig):
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.gate_up_proj = LinearColParallelMerged(
            config.hidden_size, [config.intermediate_size, config.intermediate_size], has_bias=False
        )
        self.down_proj = LinearRowParallel(config.intermediate_size, config.hidden_size, has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class RopeAttn(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool = False, has_qk_norm: bool = False):
        self.qkv_proj = LinearQKVMerged(config.hidden_size, config.head_dim, config.num_qo_heads, config.num_kv_heads,
                                        has_bias=has_attn_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.attn = AttentionLayer(layer_id, config.num_qo_heads, config.num_kv_heads, config.head_dim,
                                   config.rotary_config, q_norm=self.q_norm, k_norm=self.k_norm)
        self.o_proj = LinearOProj(config.num_qo_heads * config.head_dim, config.hidden_size, has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj.forward(self.attn.forward(self.qkv_proj.forward(x)))
