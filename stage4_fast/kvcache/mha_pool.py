from __future__ import annotations

from typing import Sequence

import torch

from ..distributed import get_tp_info
from ..kernel import store_cache
from ..kernel.ref import is_fp8
from ..utils import div_even
from .base import BaseKVCachePool


class MHAKVCache(BaseKVCachePool):
    """One preallocated buffer [2 (k/v), layers, pages, page_size, kv_heads, head_dim]; slot = page * page_size +
    offset. num_pages includes the engine's dummy page (the last one), which padding requests read and write.
    ``dtype`` is what it stores, ``compute_dtype`` what the model hands in; an fp8 pool stores ``k / k_scale`` and
    ``v / v_scale`` (per-layer scales), and readers multiply back.
    """

    def __init__(self, num_kv_heads: int, num_layers: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, compute_dtype: torch.dtype | None = None):
        self.num_kv_heads = div_even(num_kv_heads, get_tp_info().size, allow_replicate=True)
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        # empty: on CPU only written pages cost memory; the dummy page is zeroed so padded reads stay finite
        self._kv_buffer = torch.empty(2, num_layers, num_pages, page_size, self.num_kv_heads, head_dim, dtype=dtype,
                                      device=device)
        self._zero(self._kv_buffer[:, :, -1])
        if self._kv_buffer.is_cuda:
            # kernels may read a page's unused rows (FlashAttention 4): a NaN there would poison a zero weight
            self._zero(self._kv_buffer)
        # per-layer [num_slots, heads, dim] views, built once (store_kv runs every layer of every step)
        self._k_slots = [self._kv_buffer[0, i].view(-1, self.num_kv_heads, head_dim) for i in range(num_layers)]
        self._v_slots = [self._kv_buffer[1, i].view(-1, self.num_kv_heads, head_dim) for i in range(num_layers)]
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @staticmethod
    def _zero(t: torch.Tensor) -> None:
        (t.view(torch.uint8) if is_fp8(t.dtype) else t).zero_()  # fill kernels do not cover every fp8 dtype

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Per-layer scales of an fp8 pool (from the checkpoint); set before anything is stored."""
        assert is_fp8(self.dtype), "scales apply to an fp8 KV cache only"
        assert len(k_scales) == len(v_scales) == self.num_layers
        if any(s <= 0 for s in (*k_scales, *v_scales)):
            raise ValueError("KV cache scales must be positive")
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]

    def k_cache(self, index: int) -> torch.Tensor:
        return self._kv_buffer[0, index]

    def v_cache(self, index: int) -> torch.Tensor:
        return self._kv_buffer[1, index]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        # Only the new tokens' slots are written; the KV of earlier tokens is never copied. On a GPU this is one
        # JIT-built CUDA kernel for K and V together (converting to fp8 on the way for an fp8 pool).
        store_cache(self._k_slots[layer_id], self._v_slots[layer_id], out_loc, k, v,
                    self.k_scales[layer_id], self.v_scales[layer_id])

    @property
    def device(self) -> torch.device:
        return self._kv_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._kv_buffer.shape[1]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: what a slot of the pool costs."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
