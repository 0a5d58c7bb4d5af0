from __future__ import annotations

from itertools import chain
from typing import Dict, Iterable

from ..core import Batch, Req


class DecodeManager:
    """The running set: every request that has its prompt in the KV cache and may still produce tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # an ordered dict as a set (upstream: a set in address order): the same decode batch order every run
        self.running_reqs: Dict[Req, None] = {}

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        """After a launch: add the batch's requests, and drop every request that has produced its last token."""
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
        """KV tokens the running requests may still claim (page rounding included): admission leaves them free."""
        return sum(req.remain_len + self.page_size - 1 for req in self.running_reqs)

    def schedule_next_batch(self) -> Batch | None:
        if not self.running_reqs:
            return None
        return Batch(reqs=list(self.running_reqs), phase="decode")

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)
