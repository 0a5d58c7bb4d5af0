"""Prefill admission: which waiting requests enter the next prefill batch, and how much of each prompt.

A request is admitted only if its whole future KV fits beside what running requests may still claim (no preemption).
A prompt longer than the step's budget is cut into chunks (`ChunkedReq`, no token). Not upstream: a request sharing
a long uncached prefix with a prompt being prefilled waits until that prefix is in the radix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Set, Tuple

import torch

from ..core import Batch, Req
from ..kvcache.radix_cache import RadixPrefixCache, fast_compare_key
from ..utils import align_ceil, align_down
from ..utils.device import to_device
from .utils import PendingReq

if TYPE_CHECKING:
    from ..kvcache import BaseCacheHandle
    from ..message import UserMsg
    from .cache import CacheManager
    from .decode import DecodeManager
    from .table import TableManager


class ChunkedReq(Req):
    """A non-final chunk of a prompt: its sampled token is meaningless, so it never decodes."""

    @property
    def can_decode(self) -> bool:
        return False

    def append_host(self, next_token: torch.Tensor) -> None:
        raise RuntimeError("a prompt chunk produces no token")


def estimated_kv_tokens(input_len: int, output_len: int, cached_len: int, page_size: int) -> int:
    """KV slots a request may still claim, in whole pages (cached_len is page aligned)."""
    return align_ceil(input_len + output_len, page_size) - cached_len


class PrefillAdder:
    """Builds one prefill batch; lives for one scheduling step."""

    def __init__(self, token_budget: int, reserved_size: int, cache_manager: CacheManager,
                 table_manager: TableManager) -> None:
        self.token_budget = token_budget
        self.reserved_size = reserved_size
        self.cache_manager = cache_manager
        self.table_manager = table_manager

    def _fits(self, estimate: int) -> bool:
        return estimate + self.reserved_size <= self.cache_manager.available_size

    def _try_allocate_one(self, req: PendingReq) -> Tuple[BaseCacheHandle, int] | None:
        if self.table_manager.available_size == 0:
            return None
        handle = self.cache_manager.match_req(req).cuda_handle
        cached_len = handle.cached_len
        estimate = estimated_kv_tokens(req.input_len, req.output_len, cached_len, self.cache_manager.page_size)
        if not self._fits(estimate):
            return None
        self.cache_manager.lock(handle)
        if not self._fits(estimate):  # locking took the matched prefix out of the evictable pool
            self.cache_manager.unlock(handle)
            return None
        table_idx = self.table_manager.allocate()
        if cached_len > 0:
            device = self.table_manager.token_pool.device
            self.table_manager.token_pool[table_idx, :cached_len] = to_device(req.input_ids[:cached_len], device)
            self.table_manager.page_table[table_idx, :cached_len] = handle.get_matched_indices()
        return handle, table_idx

    def _add_one_req(self, pending: PendingReq, cache_handle: BaseCacheHandle, table_idx: int, cached_len: int) -> Req:
        remain_len = pending.input_len - cached_len
        chunk_size = min(self.token_budget, remain_len)
        is_chunked = chunk_size < remain_len
        self.token_budget -= chunk_size
        self.reserved_size += estimated_kv_tokens(pending.input_len, pending.output_len, cached_len,
                                                  self.cache_manager.page_size)
        end = cached_len + chunk_size
        device = self.table_manager.token_pool.device
        self.table_manager.token_pool[table_idx, cached_len:end] = to_device(pending.input_ids[cached_len:end], device)
        cls = ChunkedReq if is_chunked else Req
        return cls(input_ids=pending.input_ids[:end], table_idx=table_idx, cached_len=cached_len,
                   output_len=pending.output_len, uid=pending.uid, sampling_params=pending.sampling_params,
                   cache_handle=cache_handle)

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if (chunked := pending.chunked_req) is not None:
            # already admitted: continue where the last chunk stopped, on its slot and its locked handle
            assert chunked.cache_handle is not None
            return self._add_one_req(pending, chunked.cache_handle, chunked.table_idx, chunked.cached_len)
        if (resource := self._try_allocate_one(pending)) is None:
            return None
        handle, table_idx = resource
        return self._add_one_req(pending, handle, table_idx, handle.cached_len)


PREFIX_WAIT_MIN_TOKENS = 32  # uncached tokens a prefill in progress must share for a request to wait for it
PREFIX_PROBE_LEN = 16  # prompts in progress are indexed by this many first tokens


class PrefillManager:
    def __init__(self, cache_manager: CacheManager, table_manager: TableManager, decode_manager: DecodeManager):
        self.cache_manager = cache_manager
        self.table_manager = table_manager
        self.decode_manager = decode_manager
        self.pending_list: List[PendingReq] = []
        self.wait_for_shared_prefix = isinstance(cache_manager.prefix_cache, RadixPrefixCache)
        # prompts admitted whose prefix is not in the prefix cache yet: uid -> prompt, and probe -> uids
        self._computing: Dict[int, torch.Tensor] = {}
        self._computing_by_probe: Dict[Tuple[int, ...], Set[int]] = {}

    def add_one_req(self, req: UserMsg) -> None:
        self.pending_list.append(PendingReq(req.uid, req.input_ids, req.sampling_params))

    def schedule_next_batch(self, prefill_budget: int) -> Batch | None:
        if not self.pending_list:
            return None
        adder = PrefillAdder(prefill_budget, self.decode_manager.inflight_tokens, self.cache_manager,
                             self.table_manager)
        reqs: List[Req] = []
        chunked: List[PendingReq] = []
        waiting: List[PendingReq] = []
        for i, pending in enumerate(self.pending_list):
            if pending.chunked_req is None and self._should_wait(pending):
                waiting.append(pending)
                continue
            req = adder.try_add_one(pending)
            if req is None:
                # first come, first served: a request that does not fit now waits, and so does the queue
                rest = self.pending_list[i:]
                break
            if pending.chunked_req is None:
                self._start_computing(pending)
            pending.chunked_req = req if isinstance(req, ChunkedReq) else None
            if pending.chunked_req is not None:
                chunked.append(pending)
            reqs.append(req)
        else:
            rest = []
        if not reqs:
            return None
        # a request in the middle of its prompt goes first next step, then those that waited, in arrival order
        self.pending_list = chunked + waiting + rest
        return Batch(reqs=reqs, phase="prefill")

    def _start_computing(self, pending: PendingReq) -> None:
        if self.wait_for_shared_prefix and pending.input_len > PREFIX_PROBE_LEN:
            self._computing[pending.uid] = pending.input_ids
            probe = tuple(pending.input_ids[:PREFIX_PROBE_LEN].tolist())
            self._computing_by_probe.setdefault(probe, set()).add(pending.uid)

    def prefix_cached(self, uid: int) -> None:
        """The scheduler put this request's prompt into the prefix cache (or dropped the request)."""
        if (ids := self._computing.pop(uid, None)) is not None:
            probe = tuple(ids[:PREFIX_PROBE_LEN].tolist())
            uids = self._computing_by_probe[probe]
            uids.discard(uid)
            if not uids:
                del self._computing_by_probe[probe]

    def _should_wait(self, pending: PendingReq) -> bool:
        if not self._computing or pending.input_len <= PREFIX_PROBE_LEN:
            return False
        uids = self._computing_by_probe.get(tuple(pending.input_ids[:PREFIX_PROBE_LEN].tolist()))
        if not uids:
            return False
        usable = pending.input_len - 1  # as in match_req: the last prompt token is always computed
        shared = max(fast_compare_key(pending.input_ids[:usable], self._computing[uid]) for uid in uids)
        shared = align_down(shared, self.cache_manager.page_size)
        cached = self.cache_manager.match_req(pending).cuda_handle.cached_len
        return shared - cached >= PREFIX_WAIT_MIN_TOKENS

    def abort_req(self, uid: int) -> Req | None:
        """Drop a waiting request; returns its chunk in progress (which holds a slot and pages), if any."""
        for i, pending in enumerate(self.pending_list):
            if pending.uid == uid:
                del self.pending_list[i]
                return pending.chunked_req
        return None

    def has_req(self, uid: int) -> bool:
        return any(p.uid == uid for p in self.pending_list)

    @property
    def runnable(self) -> bool:
        return bool(self.pending_list)
