from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
