"""Messages to the API server (detokenizer / tokenizer worker -> frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from .utils import deserialize_type, serialize_type


@dataclass
class BaseFrontendMsg:
    def encoder(self) -> Dict[str, Any]:
        return serialize_type(self)

    @staticmethod
    def decoder(data: Dict[str, Any]) -> BaseFrontendMsg:
        return deserialize_type(_CLS_MAP, data)


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

    def followed_by(self, later: UserReply) -> UserReply:
        """One reply standing for this one and the next of the same request (the API server merges what queued up
        while it was busy, and writes it as one chunk)."""
        return UserReply(
            uid=self.uid,
            incremental_output=self.incremental_output + later.incremental_output,
            finished=later.finished,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens or self.prompt_tokens,
            completion_tokens=later.completion_tokens,
            cached_tokens=later.cached_tokens or self.cached_tokens,
            error=later.error,
        )


@dataclass
class StatsReply(BaseFrontendMsg):
    uid: int
    stats: Dict[str, Any] = field(default_factory=dict)


_CLS_MAP = {c.__name__: c for c in (BatchFrontendMsg, UserReply, StatsReply)}
