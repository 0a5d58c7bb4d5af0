from __future__ import annotations

from itertools import chain
from typing import Dict, List

from ..core import Batch, Req


class DecodeManager:
    """The running set: every request that has its prompt in the KV cache and may still produce tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # An insertion-ordered dict used as a set (upstream: a set, iterated in memory-address order), so the
        # order of requests in a decode batch is the same on every run.
        self.running_reqs: Dict[Req, None] = {}
        self._decode_list: List[Req] | None = None  # the request list of the decode batch handed out last

    def filter_reqs(self, reqs: List[Req]) -> None:
        """After a launch: add the batch's requests, and drop every request that has produced its last token."""
        if reqs is self._decode_list and len(reqs) == len(self.running_reqs):
            # the decode batch handed out last, and nothing left the running set since: the batch IS the running
            # set, in its order, so one pass over it (not over both) gives the same dict
            self.running_reqs = {r: None for r in reqs if r.can_decode}
            return
        self.running_reqs = dict.fromkeys(r for r in chain(self.running_reqs, reqs) if r.can_decode)

    def remove_req(self, req: Req) -> None:
        self.running_reqs.pop(req, None)

    def abort_req(self, uid: int) -> Req | None:
        for req in self.running_reqs:
            if req.uid == uid:
                del self.running_reqs[req]
                return req
        return None

    @property
    def inflight_tokens(self) -> int:
        """KV tokens the running requests may still claim (page rounding included): new admissions must leave
        them free, since a running request is never preempted."""
        return sum(req.remain_len + self.page_size - 1 for req in self.running_reqs)

    def schedule_next_batch(self) -> Batch | None:
        if not self.running_reqs:
            return None
        self._decode_list = list(self.running_reqs)
        return Batch(reqs=self._decode_list, phase="decode")

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)
