"""The prefix cache that caches nothing: every request computes its whole prompt (`--cache naive`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BaseCacheHandle, BasePrefixCache, InsertResult, MatchResult, SizeInfo


@dataclass(frozen=True)
class NaiveCacheHandle(BaseCacheHandle):
    cached_len: int = 0
    # the empty index tensor is shared by every handle: nothing ever reads past cached_len == 0
    empty: torch.Tensor | None = None

    def get_matched_indices(self) -> torch.Tensor:
        assert self.empty is not None
        return self.empty


class NaivePrefixCache(BasePrefixCache):
    def __init__(self, device: torch.device, page_size: int = 1) -> None:
        self.device = device
        self.page_size = page_size
        self._handle = NaiveCacheHandle(0, torch.empty(0, dtype=torch.int32, device=device))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        pass

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        return MatchResult(self._handle)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        # Nothing is kept, so the caller frees all of its slots itself (handle.cached_len == 0).
        return InsertResult(0, self._handle)

    def evict(self, size: int) -> torch.Tensor:
        if size > 0:
            raise NotImplementedError("the naive cache holds nothing to evict")
        return self._handle.empty  # type: ignore[return-value]

    def reset(self) -> None:
        pass

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        pass
