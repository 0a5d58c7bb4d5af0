"""Messages from the scheduler (towards the detokenizer, or the offline LLM), and from the API server to the
tokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from ..core import SamplingParams
from .utils import Message, by_name


@dataclass
class BaseTokenizerMsg(Message):
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
    # Stage 3: why a request ended and what its prompt cost, for the API's finish_reason and usage
    finish_reason: str = ""  # on the last message: "stop" (EOS / a stop token), "length", "abort" or "error"
    prompt_tokens: int = 0  # on the first token's message: the prompt's length ...
    cached_tokens: int = 0  # ... and how much of it the prefix cache served
    # on every token's message: the detokenizer keeps no per-request settings (as SGLang)
    skip_special_tokens: bool = True


@dataclass
class TokenizeMsg(BaseTokenizerMsg):
    uid: int
    # raw prompt, chat messages ([{"role", "content"}], rendered with the model's chat template) or token ids
    text: str | List[Dict[str, str]] | List[int]
    sampling_params: SamplingParams


@dataclass
class AbortMsg(BaseTokenizerMsg):
    uid: int


@dataclass
class StatsQueryMsg(BaseTokenizerMsg):
    """Asks for the scheduler's figures (/v1/stats) along the requests' path, so it also proves every worker alive."""

    uid: int


@dataclass
class StatsMsg(BaseTokenizerMsg):
    """The scheduler's answer to a ``StatsQueryMsg`` (scheduler -> detokenizer -> API)."""

    uid: int
    stats: Dict[str, Any] = field(default_factory=dict)


BaseTokenizerMsg.CLASSES = by_name(BatchTokenizerMsg, DetokenizeMsg, TokenizeMsg, AbortMsg, StatsQueryMsg, StatsMsg,
                                   SamplingParams)
