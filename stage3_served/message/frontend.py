"""Messages to the API server (detokenizer / tokenizer worker -> frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

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


@dataclass
class StatsReply(BaseFrontendMsg):
    uid: int
    stats: Dict[str, Any] = field(default_factory=dict)


BaseFrontendMsg.CLASSES = by_name(BatchFrontendMsg, UserReply, StatsReply)
