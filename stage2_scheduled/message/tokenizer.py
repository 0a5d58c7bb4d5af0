"""Messages from the scheduler (towards the detokenizer, or the offline LLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass
class BaseTokenizerMsg:
    pass


@dataclass
class BatchTokenizerMsg(BaseTokenizerMsg):
    data: List[BaseTokenizerMsg]


@dataclass
class DetokenizeMsg(BaseTokenizerMsg):
    uid: int
    next_token: int
    finished: bool
    # not upstream: a rejected or aborted request gets one final message with the reason and next_token == -1
    error: str | None = None
