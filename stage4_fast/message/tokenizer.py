"""Messages from the scheduler (towards the detokenizer, or the offline LLM), and from the API server to the
tokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from ..core import SamplingParams
from .logprobs import TokenLogprobs
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
    # next_token's logprobs (when asked); an echo request's first message also has the prompt's ids (and logprobs)
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


@dataclass
class TokenColumnsMsg(BaseTokenizerMsg):
    """One step's plain tokens (not first, not last, no logprobs) as three columns, which msgpack packs in C: row i
    is ``DetokenizeMsg(uids[i], tokens[i], False, skip_special_tokens=skip_special_tokens[i])``."""

    uids: List[int]
    tokens: List[int]
    skip_special_tokens: List[bool]

    def rows(self) -> List[DetokenizeMsg]:
        return [DetokenizeMsg(uid, token, False, skip_special_tokens=skip)
                for uid, token, skip in zip(self.uids, self.tokens, self.skip_special_tokens)]


def expand_columns(msgs: List[BaseTokenizerMsg]) -> List[BaseTokenizerMsg]:
    """``msgs`` with every ``TokenColumnsMsg`` replaced by its rows, in their place."""
    if not any(isinstance(m, TokenColumnsMsg) for m in msgs):
        return msgs
    return [row for m in msgs for row in (m.rows() if isinstance(m, TokenColumnsMsg) else [m])]


@dataclass
class TokenizeMsg(BaseTokenizerMsg):
    uid: int
    # raw prompt, chat messages (an assistant's "tool_calls", a tool's "tool_call_id") or token ids
    text: str | List[Dict[str, Any]] | List[int]
    sampling_params: SamplingParams
    # the chat template's options (add_generation_prompt, continue_final_message, the client's variables)
    chat_options: Dict[str, Any] | None = None


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


BaseTokenizerMsg.CLASSES = by_name(BatchTokenizerMsg, DetokenizeMsg, TokenColumnsMsg, TokenizeMsg, AbortMsg,
                                   StatsQueryMsg, StatsMsg, SamplingParams, TokenLogprobs)
