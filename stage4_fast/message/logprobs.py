"""Logprobs on their way to the client: token ids from the scheduler, token text from the detokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List


class _Run:
    def extend(self, other: _Run) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            getattr(self, f.name).extend(getattr(other, f.name))


@dataclass
class TokenLogprobs(_Run):
    """Tokens with their logprobs and the most likely tokens' (scheduler -> detokenizer); an echoed prompt's first
    token has logprob None (nothing predicts it)."""

    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float | None] = field(default_factory=list)
    top_ids: List[List[int]] = field(default_factory=list)  # most likely first
    top_logprobs: List[List[float]] = field(default_factory=list)


@dataclass
class TextLogprobs(_Run):
    """The same run with every token as text (detokenizer -> API server)."""

    tokens: List[str] = field(default_factory=list)
    logprobs: List[float | None] = field(default_factory=list)
    top_tokens: List[List[str]] = field(default_factory=list)
    top_logprobs: List[List[float]] = field(default_factory=list)
