"""From a request's replies to what the client sees: stop strings, finish reason, usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, List

from .frontend import FrontendManager, RequestRejected


class StopStringMatcher:
    """Cuts a text stream before the first occurrence of any stop string, wherever the chunks split.

    A chunk's tail that could be the start of a stop string is held back until the next chunk decides; so the
    output never depends on where the chunks split: the text before the stop string that completes first.
    """

    def __init__(self, stops: List[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        # the stop string that completes first wins (as when checking after every token); on a tie the longer one
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)[1]], True
        keep = 0
        for s in self.stops:  # the longest suffix of buf that is a proper prefix of some stop string
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclass
class Delta:
    text: str
    finish_reason: str | None  # None while the request runs
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


async def generate_deltas(
    frontend: FrontendManager, prompt: object, sampling_params: object, stops: List[str]
) -> AsyncIterator[Delta]:
    """One Delta per reply (text may be empty), the last one with its finish reason. Stopping early (stop string,
    client gone, generator closed) aborts the request in the backend (``FrontendManager.replies``)."""
    matcher = StopStringMatcher(stops)
    uid = frontend.submit(prompt, sampling_params)
    replies = frontend.replies(uid)
    try:
        async for reply in replies:
            if reply.error:
                raise RequestRejected(reply.error)
            text, hit = matcher.feed(reply.incremental_output)
            if reply.finished and not hit:
                text += matcher.flush()
            finish = "stop" if hit else (reply.finish_reason or "stop") if reply.finished else None
            yield Delta(text, finish, reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens)
            if finish is not None:
                return
    finally:
        await replies.aclose()
