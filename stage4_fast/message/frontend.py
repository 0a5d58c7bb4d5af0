"""Messages to the API server (detokenizer / tokenizer worker -> frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from .logprobs import TextLogprobs
from .utils import Message, by_name


@dataclass
class BaseFrontendMsg(Message):
    pass


@dataclass
class BatchFrontendMsg(BaseFrontendMsg):
    data: List[BaseFrontendMsg]


@dataclass
class UserReply(BaseFrontendMsg):
    """Text produced by one more token of request ``uid``; usage so far rides along (not upstream)."""

    uid: int
    incremental_output: str
    finished: bool
    finish_reason: str = ""  # see DetokenizeMsg
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # the request was rejected (tokenizer or scheduler); the API answers with a 4xx
    # the logprobs of this text's tokens (when asked); an echo request's first reply also has its prompt's
    logprobs: TextLogprobs | None = None
    prompt_logprobs: TextLogprobs | None = None
    prompt_text: str | None = None

    def followed_by(self, later: UserReply) -> UserReply:
        # (only a first reply has prompt logprobs and text)
        return UserReply(self.uid, self.incremental_output + later.incremental_output, later.finished,
                         later.finish_reason, later.prompt_tokens or self.prompt_tokens, later.completion_tokens,
                         later.cached_tokens or self.cached_tokens, later.error, _joined(self.logprobs, later.logprobs),
                         self.prompt_logprobs or later.prompt_logprobs,
                         self.prompt_text if self.prompt_text is not None else later.prompt_text)


def _joined(first: TextLogprobs | None, second: TextLogprobs | None) -> TextLogprobs | None:
    if first is None or second is None:
        return first or second
    joined = TextLogprobs()
    joined.extend(first)
    joined.extend(second)
    return joined


@dataclass
class StatsReply(BaseFrontendMsg):
    uid: int
    stats: Dict[str, Any] = field(default_factory=dict)


BaseFrontendMsg.CLASSES = by_name(BatchFrontendMsg, UserReply, StatsReply, TextLogprobs)
