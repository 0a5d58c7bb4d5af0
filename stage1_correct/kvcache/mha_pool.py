from __future__ import annotations

import torch

from ..distributed import get_tp_info
from ..utils import div_even
from .base import BaseKVCachePool


class MHAKVCache(BaseKVCachePool):
    """One preallocated buffer [2 (k/v), layers, pages, page_size, kv_heads, head_dim]; slot = page * page_size +
    offset. num_pages includes the engine's dummy page (the last one), which padding requests read and write.
    """

    def __init__(self, num_kv_heads: int, num_layers: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_kv_heads = div_even(num_kv_heads, get_tp_info().size, allow_replicate=True)
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        # empty: on CPU only written pages cost memory; the dummy page is zeroed so padded reads stay finite
        self._kv_buffer = torch.empty(2, num_layers, num_pages, page_size, self.num_kv_heads, head_dim, dtype=dtype,
                                      device=device)
        self._kv_buffer[:, :, -1].zero_()
        # per-layer [num_slots, heads, dim] views, built once (store_kv runs every layer of every step)
        self._k_slots = [self._kv_buffer[0, i].view(-1, self.num_kv_heads, head_dim) for i in range(num_layers)]
        self._v_slots = [self._kv_buffer[1, i].view(-1, self.num_kv_heads, head_dim) for i in range(num_layers)]

    def k_cache(self, index: int) -> torch.Tensor:
        return self._kv_buffer[0, index]

    def v_cache(self, index: int) -> torch.Tensor:
        return self._kv_buffer[1, index]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        # Only the new tokens' slots are written; the KV of earlier tokens is never copied.
        self._k_slots[layer_id][out_loc] = k
        self._v_slots[layer_id][out_loc] = v

    @property
    def device(self) -> torch.device:
        return self._kv_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._kv_buffer.shape[1]
