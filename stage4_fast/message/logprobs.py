"""Logprobs on their way to the client: token ids from the scheduler, token text from the detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class TokenLogprobs:
    """Tokens with their logprobs and the most likely tokens' (scheduler -> detokenizer); an echoed prompt's first
    token has logprob None (nothing predicts it)."""

    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float | None] = field(default_factory=list)
    top_ids: List[List[int]] = field(default_factory=list)  # most likely first
    top_logprobs: List[List[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


@dataclass
class TextLogprobs:
    """The same run with every token as text (detokenizer -> API server)."""

    tokens: List[str] = field(default_factory=list)
    logprobs: List[float | None] = field(default_factory=list)
    top_tokens: List[List[str]] = field(default_factory=list)
    top_logprobs: List[List[float]] = field(default_factory=list)

    def extend(self, other: TextLogprobs) -> None:
        self.tokens += other.tokens
        self.logprobs += other.logprobs
        self.top_tokens += other.top_tokens
        self.top_logprobs += other.top_logprobs
