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
    # Not upstream: a request the scheduler rejects (prompt too long, can never fit) or aborts gets one final
    # message with the reason here and next_token == -1, instead of no reply at all (upstream bug 6).
    error: str | None = None
