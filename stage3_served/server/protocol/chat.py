"""/v1/chat/completions: the messages."""

from __future__ import annotations

from typing import ClassVar, Dict, List, Literal, Mapping

from pydantic import Field

from .common import NI, MaxTokens, NotImplementedField, Strict
from .sampling import NOT_IMPLEMENTED_SAMPLING, SamplingFields

NOT_IMPLEMENTED_CHAT: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
    "logprobs": NI((False,), "log probabilities"),
    "top_logprobs": NI((0,), "log probabilities"),
    "tools": NI(([],), "tool calls"),
    "tool_choice": NI(("none",), "tool calls"),
    "parallel_tool_calls": NI((), "tool calls"),
    "functions": NI(([],), "function calls"),
    "function_call": NI(("none",), "function calls"),
    "modalities": NI((["text"],), "output other than text"),
    "audio": NI((), "audio output"),
    "prediction": NI((), "predicted outputs"),
    "reasoning_effort": NI((), "reasoning effort"),
    "web_search_options": NI((), "web search"),
}


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | List[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_CHAT
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = Field(None, description="newer name of max_tokens")
