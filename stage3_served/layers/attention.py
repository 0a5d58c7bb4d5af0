from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..utils import div_even
from .base import StateLessOP
from .norm import RMSNorm
from .rotary import get_rope

if TYPE_CHECKING:
    from ..models.config import RotaryConfig


class AttentionLayer(StateLessOP):
    """Splits the fused qkv, applies the optional per-head q/k norm (Qwen3) and RoPE, then hands q/k/v to the
    context's attention backend, which stores this step's K/V in the pool and attends against the pool."""

    def __init__(self, layer_id: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, rotary_config: RotaryConfig,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        tp = get_tp_info().size
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.num_qo_heads = div_even(num_qo_heads, tp)
        self.num_kv_heads = div_even(num_kv_heads, tp, allow_replicate=True)
        self.qo_attn_dim = self.num_qo_heads * head_dim
        self.kv_attn_dim = self.num_kv_heads * head_dim
        scaling = rotary_config.scaling
        self.rotary = get_rope(rotary_config.head_dim, rotary_config.rotary_dim, rotary_config.max_position,
                               rotary_config.base, tuple(sorted(scaling.items())) if scaling else None)
        self._q_norm = q_norm  # owned (and loaded) by the parent attention block
        self._k_norm = k_norm

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        T, Hq, Hkv, D = qkv.shape[0], self.num_qo_heads, self.num_kv_heads, self.head_dim
        if self._q_norm is not None and self._k_norm is not None:
            q, k, _ = qkv.split([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim], dim=-1)
            qk = torch.cat([self._q_norm.forward(q.view(T, Hq, D)), self._k_norm.forward(k.view(T, Hkv, D))], dim=1)
        else:
            qk = qkv[:, : self.qo_attn_dim + self.kv_attn_dim].view(T, Hq + Hkv, D)
        qk, _ = self.rotary.forward(ctx.batch.positions, qk)  # q and k heads rotated in one pass
        q, k = qk[:, :Hq], qk[:, Hq:]
        v = qkv[:, self.qo_attn_dim + self.kv_attn_dim :].view(T, Hkv, D)
        o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        return o.view(T, self.qo_attn_dim)
