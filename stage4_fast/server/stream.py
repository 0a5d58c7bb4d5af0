"""From a request's replies to what the client sees: stop strings, finish reason, usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, Dict, List

from ..message import TextLogprobs
from .frontend import FrontendManager, RequestRejected
from .tags import tag_start_len


class StopStringMatcher:
    """Cuts a text stream before the first stop string, wherever the chunks split (``keep_stop``: keeps it)."""

    def __init__(self, stops: List[str], keep_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.keep_stop = keep_stop
        self.held = ""
        self.held_unarmed = 0  # how many of held's first characters came while not armed
        self.overlap = max(map(len, self.stops), default=1) - 1  # the most of a stop string that text can end with

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit); one counts only if it ends in ``armed`` text."""
        if not self.stops:
            return text, False
        buf, unarmed = self.held + text, self.held_unarmed
        if not armed:
            keep = min(len(buf), self.overlap)
            self.held, self.held_unarmed = buf[len(buf) - keep :], keep
            return buf[: len(buf) - keep], False
        # the stop string that completes first wins (as when checking after every token); on a tie the longer one
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s, max(0, unarmed - len(s) + 1))) >= 0]
        if hits:
            self.held, self.held_unarmed = "", 0
            end, start = min(hits)
            return buf[: end if self.keep_stop else start], True
        keep = max(tag_start_len(buf, s) for s in self.stops)  # the longest tail that could start a stop string
        self.held, self.held_unarmed = buf[len(buf) - keep :], max(0, unarmed - (len(buf) - keep))
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        text, self.held, self.held_unarmed = self.held, "", 0
        return text


@dataclass
class Delta:
    text: str
    finish_reason: str | None  # None while the request runs
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # the logprobs of the delta's tokens (when asked); an echo request's first delta also has the prompt's
    logprobs: TextLogprobs | None = None
    prompt_text: str | None = None
    prompt_logprobs: TextLogprobs | None = None


class DeltaStream:
    """One request's deltas; it was submitted in the handler's own step (a task would wait behind a busy loop's turn),
    and closing the stream aborts it unless finished."""

    def __init__(self, frontend: FrontendManager, uid: int, deltas: AsyncGenerator[Delta, None]) -> None:
        self.frontend, self.uid, self._deltas = frontend, uid, deltas
        self._started = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        self._started = True
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        if not self._started:  # never read: its reply loop, which aborts a request on exit, never ran
            self._started = True
            self.frontend.abandon(self.uid)
        await self._deltas.aclose()


def generate_deltas(frontend: FrontendManager, prompt: object, sampling_params: object, stops: List[str],
                    chat_options: Dict[str, Any] | None = None, keep_stop: bool = False, min_tokens: int = 0,
                    user: str | None = None) -> DeltaStream:
    """Submit the request now; its stream gives a Delta per reply, the last with its finish reason."""
    uid = frontend.submit(prompt, sampling_params, chat_options, user)
    return DeltaStream(frontend, uid, _deltas(frontend, uid, StopStringMatcher(stops, keep_stop), min_tokens))


async def _deltas(frontend: FrontendManager, uid: int, matcher: StopStringMatcher,
                  min_tokens: int) -> AsyncGenerator[Delta, None]:
    armed_after = min_tokens if matcher.stops else 0
    replies = frontend.replies(uid, keep_apart_after=armed_after)
    try:
        async for reply in replies:
            if reply.error:
                raise RequestRejected(reply.error)
            text, hit = matcher.feed(reply.incremental_output, armed=reply.completion_tokens > armed_after)
            if reply.finished and not hit:
                text += matcher.flush()
            finish = "stop" if hit else (reply.finish_reason or "stop") if reply.finished else None
            yield Delta(text, finish, reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens,
                        reply.logprobs, reply.prompt_text, reply.prompt_logprobs)
            if finish is not None:
                return
    finally:
        await replies.aclose()
