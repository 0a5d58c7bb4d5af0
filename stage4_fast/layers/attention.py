from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..kernel import fused_kernels_for, is_fp8
from ..utils import div_even
from .base import StateLessOP
from .norm import RMSNorm, scale_by_rms_of
from .rotary import get_rope

if TYPE_CHECKING:
    from ..models.config import RotaryConfig


def fused_kv_store_applies(pool_dtype: torch.dtype, activation_dtype: torch.dtype) -> bool:
    """Whether the fused q/k norm + RoPE kernel also writes this step's K/V into the pool (one launch less): where
    the pool stores the activations' dtype, or fp8 (quantized in the kernel)."""
    return pool_dtype == activation_dtype or is_fp8(pool_dtype)


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

    def forward(self, qkv: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """``row_scale`` = (hidden, eps): qkv projects the unnormalised rows of ``hidden`` (the layer's input norm
        deferred, models/decoder.py); each token's q, k and v are first scaled by RMSNorm's factor of its row."""
        ctx = get_global_ctx()
        T, Hkv, D = qkv.shape[0], self.num_kv_heads, self.head_dim
        kv_stored = False
        if (fused := fused_kernels_for(qkv)) is not None and qkv.stride(-1) == 1:
            # 16-bit on a GPU: q/k norm and RoPE in one kernel that writes q and k contiguous, and this step's K/V
            # into the pool (quantized there for an fp8 pool); with a row scale it scales v in qkv too
            kv_stored = fused_kv_store_applies(ctx.kv_cache.dtype, qkv.dtype)
            q, k = self._fused_qk(fused, qkv, ctx.batch.positions, ctx.batch.out_loc if kv_stored else None, row_scale)
        else:
            if row_scale is not None:
                qkv = scale_by_rms_of(qkv, *row_scale)
            q, k = self._qk(qkv, ctx.batch.positions)
        v = qkv[:, self.qo_attn_dim + self.kv_attn_dim :].view(T, Hkv, D)
        o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch, kv_stored=kv_stored)
        return o.view(T, self.qo_attn_dim)

    def _fused_qk(self, fused, qkv: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor | None,
                  row_scale: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = self._q_norm, self._k_norm
        has_norm = qn is not None and kn is not None
        eps = qn.eps if has_norm else 0.0
        assert not has_norm or kn.eps == eps
        kv_store, kv_scales = None, (1.0, 1.0)
        if out_loc is not None:  # the pool's slots of this layer, [num_slots, Hkv, D], and an fp8 pool's scales
            pool = get_global_ctx().kv_cache
            shape = (-1, self.num_kv_heads, self.head_dim)
            kv_store = (pool.k_cache(self.layer_id).view(shape), pool.v_cache(self.layer_id).view(shape), out_loc)
            kv_scales = (pool.k_scales[self.layer_id], pool.v_scales[self.layer_id])
        return fused.qk_norm_rope(qkv, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                  qn.weight if has_norm else None, kn.weight if has_norm else None, eps,
                                  self.rotary.cos_sin_cache, positions, kv_store, kv_scales, row_scale)

    def _qk(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, Hq, Hkv, D = qkv.shape[0], self.num_qo_heads, self.num_kv_heads, self.head_dim
        if self._q_norm is not None and self._k_norm is not None:
            q, k, _ = qkv.split([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim], dim=-1)
            qk = torch.cat([self._q_norm.forward(q.view(T, Hq, D)), self._k_norm.forward(k.view(T, Hkv, D))], dim=1)
        else:
            qk = qkv[:, : self.qo_attn_dim + self.kv_attn_dim].view(T, Hq + Hkv, D)
        qk, _ = self.rotary.forward(positions, qk)  # q and k heads rotated in one pass
        return qk[:, :Hq], qk[:, Hq:]
