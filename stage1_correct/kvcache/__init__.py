from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import BaseCacheHandle, BaseKVCachePool
from .mha_pool import MHAKVCache

if TYPE_CHECKING:
    from ..models import ModelConfig


def create_kvcache_pool(model_config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                        device: torch.device) -> BaseKVCachePool:
    return MHAKVCache(num_kv_heads=model_config.num_kv_heads, num_layers=model_config.num_layers,
                      head_dim=model_config.head_dim, num_pages=num_pages, page_size=page_size, dtype=dtype,
                      device=device)


__all__ = ["BaseCacheHandle", "BaseKVCachePool", "MHAKVCache", "create_kvcache_pool"]
