from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch


class BaseKVCachePool(ABC):
    @abstractmethod
    def k_cache(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write this step's K/V rows ([T, kv_heads, head_dim]) into the token slots out_loc ([T]) of one layer."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class BaseCacheHandle(ABC):
    """A matched prefix in a prefix cache (the prefix caches arrive with the scheduler in stage2)."""

    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor: ...


# --- prefix caches (stage 2): KV slots of earlier prompts, handed out as handles locked while in use ------------


class SizeInfo(NamedTuple):
    evictable_size: int  # tokens that nobody uses and that evict() may take back
    protected_size: int  # tokens locked by running requests

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class InsertResult(NamedTuple):
    cached_len: int  # prefix that was ALREADY cached before the insert: the caller's own slots there are duplicates
    handle: BaseCacheHandle  # covers the whole inserted (page-aligned) prefix


class MatchResult(NamedTuple):
    cuda_handle: BaseCacheHandle  # upstream's name; the handle lives wherever the KV pool lives


class BasePrefixCache(ABC):
    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protect (or release) the slots of a handle from eviction; locks nest."""

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        """Longest cached page-aligned prefix of input_ids. Lock the handle before using its indices."""

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        """Give the slots `indices` holding KV of `input_ids` to the cache (only the page-aligned part)."""

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Take back at least `size` tokens of unlocked entries, least recently used first; returns their slots."""

    @abstractmethod
    def reset(self) -> None: ...

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None: ...
