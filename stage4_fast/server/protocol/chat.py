"""/v1/chat/completions: the messages, the tools and the chat template's options."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Mapping, Union

from pydantic import ConfigDict, Field, model_validator

from .common import NI, MaxTokens, NotImplementedField, SafeInt, Strict, TopLogprobs
from .sampling import NOT_IMPLEMENTED_SAMPLING, SamplingFields, sampling_request_rules
from .tools import NamedToolChoice, Tool, ToolCall

# a chat template variable: a JSON scalar (larger integers read as numbers), or a list or object of them
JSONScalar = Union[str, bool, SafeInt, float, None]
TemplateValue = Union[JSONScalar, List[JSONScalar], Dict[str, JSONScalar]]
NOT_IMPLEMENTED_CHAT: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
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


Content = str | List[TextPart]


def _text(content: Content | None) -> str:
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


class SystemOrUserMessage(Strict):
    role: Literal["system", "user"]
    content: Content

    def for_template(self) -> Dict[str, Any]:
        return {"role": self.role, "content": _text(self.content)}


def _assistant_rules(schema: Dict[str, Any], cls: type) -> None:
    # the schema states the rule _check_content enforces: content, or tool calls
    schema["anyOf"] = [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                       {"required": ["tool_calls"], "properties": {"tool_calls": {"not": {"type": "null"},
                                                                                  "minItems": 1}}}]


class AssistantMessage(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_assistant_rules)
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: List[ToolCall] | None = Field(None, description="the calls this turn made (content may be null)")

    @model_validator(mode="after")
    def _check_content(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def for_template(self) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": _text(self.content)}
        if self.tool_calls:
            # templates write the arguments as JSON themselves (`| tojson`): they get the object, as in vLLM
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(description="the call this message answers")

    def for_template(self) -> Dict[str, Any]:
        return {"role": "tool", "content": _text(self.content), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemOrUserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


# apply_chat_template's own parameters and render names: chat_template_kwargs may not set these
CHAT_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                    "add_generation_prompt", "continue_final_message", "tokenize",
                                    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
                                    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_rules(schema: Dict[str, Any]) -> None:
    # the schema states the rules ChatTemplateFields enforces
    both = ["add_generation_prompt", "continue_final_message"]
    schema["not"] = {"properties": {name: {"const": True} for name in both}, "required": both}
    kwargs = schema["properties"]["chat_template_kwargs"]["anyOf"][0]
    kwargs["propertyNames"] = {"not": {"enum": sorted(CHAT_TEMPLATE_RESERVED)}}


def _chat_request_rules(schema: Dict[str, Any], cls: type) -> None:
    sampling_request_rules(schema, cls)
    template_rules(schema)
    # top_logprobs only with logprobs (OpenAI's and vLLM's)
    schema["if"] = {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]}
    schema["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}


class ChatTemplateFields(Strict):
    """What renders chat messages into a prompt: vLLM's and SGLang's chat template options, and the tools."""

    add_generation_prompt: bool | None = Field(None, description="end with the assistant header (default: true, "
                                                                 "unless continue_final_message)")
    continue_final_message: bool = Field(False, description="the model continues the last message")
    chat_template_kwargs: Dict[str, TemplateValue] | None = Field(None, description="more chat template variables")
    tools: List[Tool] | None = Field(None, description="functions the model may call")

    @model_validator(mode="after")
    def _check_template_options(self) -> ChatTemplateFields:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        reserved = sorted(CHAT_TEMPLATE_RESERVED.intersection(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved[0]!r} (a parameter of the template call; "
                             f"use the request field where there is one)")
        return self

    def tool_dicts(self) -> List[Dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def chat_options(self) -> Dict[str, Any] | None:
        """The template's keyword arguments beyond the default (None); tools go to it whatever the tool_choice."""
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        if add and not self.continue_final_message and not self.chat_template_kwargs and not self.tools:
            return None
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": add,
                "continue_final_message": self.continue_final_message,
                **({"tools": self.tool_dicts()} if self.tools else {})}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_chat_request_rules)
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_CHAT
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = Field(None, description="newer name of max_tokens")
    logprobs: bool = Field(False, description="the logprob of every output token")
    top_logprobs: TopLogprobs | None = Field(None, description="and of the most likely ones (needs logprobs)")
    # SGLang's (sglang-router sends them): what --reasoning-parser does with a thinking block (nothing without one)
    separate_reasoning: bool = Field(True, description="SGLang extension: the thinking block to reasoning_content")
    stream_reasoning: bool = Field(True, description="SGLang extension: false sends the reasoning whole at its end")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools (needs --tool-call-parser), none without")
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call")

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice other than none needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.forced_tool() and self.grammar():
            raise ValueError("tool_choice required or a named tool holds the output to JSON already: no other "
                             "structured output with it")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        return self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"

    def forced_tool(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
