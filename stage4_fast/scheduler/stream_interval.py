"""SGLang's ``--stream-interval N``: a streaming request's tokens leave the scheduler every N steps instead of every
step; its first token and its last leave at once (SGLang's ``stream_output``: the first output, a finished request,
or a step count divisible by N; SGLang counts decode steps, this counter every processed step, prefill ones too).

Every token still reaches the detokenizer, in order; what changes is how often the processes after the scheduler
wake up for a request. Nothing is held for good: a request's last token takes what was held of it, and an abort
takes it first (``release``). The API server merges a request's queued replies into one chunk, so with N > 1 it
writes about N times fewer chunks (socket writes dominate its cost in a streaming burst).
"""

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
        # a request's first token (it reports the prompt) and its last leave at once, with what was held before them
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
        """Messages waiting for a later step."""
        return len(self._held)
