"""Blocks shared by the decoder architectures."""

from __future__ import annotations

import torch

from ..layers import (
    AttentionLayer,
    BaseOP,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearReplicated,
    LinearRowParallel,
    MoELayer,
    RMSNorm,
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
        # silu(gate) * up, then down_proj: F.linear after the SiLU-and-mul kernel, or one GEMV for a single token
        return self.down_proj.forward(self.gate_up_proj.forward(x), silu_mul_input=True)


class MoEMLP(BaseOP):
    """Sparse MLP: a replicated router picks top-k experts per token (Qwen3-MoE)."""

    def __init__(self, config: ModelConfig):
        self.experts = MoELayer(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                activation=config.hidden_act)
        self.gate = LinearReplicated(config.hidden_size, config.num_experts, has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward(x, self.gate.forward(x))


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
