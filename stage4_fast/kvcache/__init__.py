from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..utils import Registry
from .base import BaseCacheHandle, BaseKVCachePool, BasePrefixCache, InsertResult, MatchResult, SizeInfo
from .dtype import KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPES, is_fp8, kv_cache_dtype_name, resolve_kv_cache_dtype
from .mha_pool import MHAKVCache
from .naive_cache import NaivePrefixCache
from .radix_cache import RadixPrefixCache

if TYPE_CHECKING:
    from ..models import ModelConfig


def create_kvcache_pool(model_config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                        device: torch.device, kv_dtype: torch.dtype | None = None) -> BaseKVCachePool:
    """A pool for the model's KV layers; ``kv_dtype`` is what it stores (default: the model's ``dtype``)."""
    return MHAKVCache(num_kv_heads=model_config.num_kv_heads, num_layers=model_config.num_kv_layers,
                      head_dim=model_config.head_dim, num_pages=num_pages, page_size=page_size,
                      dtype=dtype if kv_dtype is None else kv_dtype, device=device, compute_dtype=dtype)


SUPPORTED_CACHE_MANAGER: Registry[type[BasePrefixCache]] = Registry("cache manager")
SUPPORTED_CACHE_MANAGER.register("naive")(NaivePrefixCache)
SUPPORTED_CACHE_MANAGER.register("radix")(RadixPrefixCache)


def create_prefix_cache(device: torch.device, type: str, page_size: int = 1) -> BasePrefixCache:
    # upstream: create_prefix_cache(device, type), the radix tree reading the page size from the global context
    return SUPPORTED_CACHE_MANAGER[type](device, page_size)


__all__ = ["BaseCacheHandle", "BaseKVCachePool", "BasePrefixCache", "InsertResult", "KV_CACHE_DTYPES",
           "KV_CACHE_DTYPE_CHOICES", "MHAKVCache", "MatchResult", "NaivePrefixCache", "RadixPrefixCache",
           "SUPPORTED_CACHE_MANAGER", "SizeInfo", "create_kvcache_pool", "create_prefix_cache", "is_fp8",
           "kv_cache_dtype_name", "resolve_kv_cache_dtype"]
