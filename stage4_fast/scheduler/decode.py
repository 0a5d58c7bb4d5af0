from __future__ import annotations

from typing import Dict, Iterable, Sequence

from ..core import Batch, Req


class DecodeManager:
    """The running set: every request that has its prompt in the KV cache and may still produce tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # an ordered dict as a set (upstream: a set in address order): the same decode batch order every run
        self.running_reqs: Dict[Req, None] = {}
        self._version = 0  # bumped whenever the running set changes; a decode batch remembers its own
        self._batch_version = -1

    def filter_reqs(self, reqs: Iterable[Req], length_finished: Sequence[bool] | None = None) -> None:
        """After a launch: add the batch's requests, drop those that produced their last token. ``length_finished``
        (a decode batch's, per request): used directly while the running set is still the batch's."""
        self._version += 1
        if length_finished is not None and self._batch_version == self._version - 1:
            self.running_reqs = dict.fromkeys(r for r, done in zip(reqs, length_finished) if not done)
            return
        running = {r: None for r in self.running_reqs if r.can_decode}
        # a prefill batch's requests join; a decode batch's are the running set itself, judged once above
        running.update((r, None) for r in reqs if r not in self.running_reqs and r.can_decode)
        self.running_reqs = running

    def remove_req(self, req: Req) -> None:
        self._version += 1
        self.running_reqs.pop(req, None)

    def abort_req(self, uid: int) -> Req | None:
        for req in self.running_reqs:
            if req.uid == uid:
                self._version += 1
                del self.running_reqs[req]
                return req
        return None

    @property
    def inflight_tokens(self) -> int:
        """KV tokens the running requests may still claim (page rounding included): admission leaves them free."""
        return sum(req.remain_len + self.page_size - 1 for req in self.running_reqs)

    def join(self, batch: Batch) -> None:
        """Mixed chunks: append the running requests to a prefill batch for their decode step."""
        batch.reqs.extend(self.running_reqs)
        batch.decode_reqs = len(self.running_reqs)

    def schedule_next_batch(self) -> Batch | None:
        if not self.running_reqs:
            return None
        self._batch_version = self._version
        return Batch(reqs=list(self.running_reqs), phase="decode")

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)
