"""KV page bookkeeping: the free list, the prefix cache, and which page-table entries a request owns.

Per request row: [0, cache_handle.cached_len) are the prefix cache's slots (handle locked), the rest up to
align_ceil(cached_len) pages it owns alone. Every page is free, in the prefix cache, or owned by one request."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, List, Tuple

import torch

from ..kvcache import BaseCacheHandle, MatchResult, create_prefix_cache
from ..utils import align_ceil
from ..utils.device import to_device_packed
from .utils import run_indices

if TYPE_CHECKING:
    from ..core import Req
    from .utils import PendingReq


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor, type: str) -> None:
        self.device = page_table.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        # free memory as page starts (token index of each page's first slot), as upstream
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        self.prefix_cache = create_prefix_cache(self.device, type, page_size)
        self._page_offsets = torch.arange(page_size, dtype=torch.int32, device=self.device)
        self._lazy_frees: List[torch.Tensor] | None = None

    def match_req(self, req: PendingReq) -> MatchResult:
        # never the last prompt token (it makes the first logits); echo with logprobs needs every prompt logit
        assert req.input_len > 0
        usable = 0 if req.sampling_params.wants_prompt_logprobs else req.input_len - 1
        return self.prefix_cache.match_prefix(req.input_ids[:usable])

    @property
    def available_size(self) -> int:
        """Tokens that could be allocated now: free pages plus what eviction could return."""
        return self.prefix_cache.size_info.evictable_size + self.free_slots.shape[0] * self.page_size

    def lock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def allocate_paged(self, reqs: List[Req], one_each_at: Tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Pages for each row's [align_ceil(cached_len), align_ceil(device_len)); ``one_each_at``: decode's cells."""
        ps = self.page_size
        if ps == 1 and one_each_at is not None:
            self.page_table[one_each_at] = self._allocate(len(reqs))
            return
        rows: List[int] = []
        firsts: List[int] = []
        counts: List[int] = []
        for req in reqs:
            first, last = align_ceil(req.cached_len, ps), align_ceil(req.device_len, ps)
            if last > first:
                rows.append(req.table_idx)
                firsts.append(first)
                counts.append(last - first)
        if not rows:
            return
        slots = self._page_to_token(self._allocate(sum(counts) // ps))
        index = to_device_packed(list(run_indices(rows, firsts, counts)), self.device)
        self.page_table[tuple(index)] = slots

    def _allocate(self, needed_pages: int) -> torch.Tensor:
        if needed_pages > len(self.free_slots):
            evicted = self.prefix_cache.evict((needed_pages - len(self.free_slots)) * self.page_size)
            # tree nodes hold whole pages, so every page_size-th evicted slot is a page start
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
        assert needed_pages <= len(self.free_slots), "admission control let a request exceed the KV pool"
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def _page_to_token(self, pages: torch.Tensor) -> torch.Tensor:
        return pages if self.page_size == 1 else (pages.view(-1, 1) + self._page_offsets).view(-1)

    def _free(self, indices: torch.Tensor) -> None:
        """Return the pages of a page-aligned run of token slots."""
        if len(indices) == 0:
            return
        pages = indices[:: self.page_size]
        if self._lazy_frees is not None:
            self._lazy_frees.append(pages.clone())  # may be a view of the page table, which changes later
        else:
            self.free_slots = torch.cat([self.free_slots, pages])

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Collect the frees of a whole step and concatenate once."""
        assert self._lazy_frees is None, "lazy_free_region does not nest"
        self._lazy_frees = []
        try:
            yield
        finally:
            frees, self._lazy_frees = self._lazy_frees, None
            if frees:
                self.free_slots = torch.cat([self.free_slots, *frees])

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Hand the request's computed prefix [0, cached_len) to the prefix cache. Not finished: it keeps running on
        a new, longer locked handle; finished: all it owned goes to the cache or the free list."""
        row = req.table_idx
        page_indices = self.page_table[row, : req.cached_len]
        old_handle = req.cache_handle
        assert old_handle is not None
        in_cache_len, new_handle = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], page_indices)
        # [old cached_len, in_cache_len): another request inserted it meanwhile; the cache keeps its copy
        duplicates = page_indices[old_handle.cached_len : in_cache_len].clone()  # the row is rewritten below
        if finished:
            self._free(duplicates)
            self._free(page_indices[new_handle.cached_len :])  # the unaligned tail the cache did not take
            self.unlock(old_handle)
        else:
            if in_cache_len > old_handle.cached_len:
                # keep reading the cache's copy (same tokens, same KV): ours is about to be reused
                start, matched = old_handle.cached_len, new_handle.get_matched_indices()
                self.page_table[row, start:in_cache_len] = matched[start:in_cache_len]
            self._free(duplicates)
            self.lock(new_handle)  # lock the new path before unlocking the old, so no node is evictable between
            self.unlock(old_handle)
            req.cache_handle = new_handle

    def check_integrity(self, deep: bool = True) -> None:
        """When idle: every page is free or cached (O(1)); deep: none twice, and the prefix cache's invariants."""
        size = self.prefix_cache.size_info
        if deep:
            self.prefix_cache.check_integrity()
            assert len(torch.unique(self.free_slots)) == len(self.free_slots), "a page is on the free list twice"
        assert size.protected_size == 0, f"{size.protected_size} tokens still locked while idle"
        cached_pages = size.total_size // self.page_size
        assert len(self.free_slots) + cached_pages == self.num_pages, \
            f"{len(self.free_slots)} free + {cached_pages} cached pages != {self.num_pages}"
