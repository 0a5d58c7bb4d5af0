"""SGLang's ``--stream-interval N``: a request's tokens leave the scheduler every N processed steps (prefill ones
too), its first and last at once. Every token still reaches the detokenizer, in order; an abort takes what was held
first (``release``). The API server merges queued replies, so it writes about N times fewer chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, List

from ..message import DetokenizeMsg


@dataclass
class StreamInterval:
    interval: int = 1
    _steps: int = 0
    _held: List[DetokenizeMsg] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.interval}")

    def step(self, reply: List[DetokenizeMsg]) -> List[DetokenizeMsg]:
        """One step's messages -> the ones to send now; the others are held, in order, for a later step."""
        if self.interval == 1:
            return reply
        self._steps += 1
        if self._steps % self.interval == 0:
            out, self._held = self._held + reply, []
            return out
        self._held += reply
        return self.release({m.uid for m in reply if m.finished or m.prompt_tokens})

    def release(self, uids: Collection[int]) -> List[DetokenizeMsg]:
        """The held messages of these requests, in order (before a message that ends one of them, e.g. an abort)."""
        if not uids or not self._held:
            return []
        out = [m for m in self._held if m.uid in uids]
        if out:
            self._held = [m for m in self._held if m.uid not in uids]
        return out

    @property
    def held(self) -> int:
        return len(self._held)
