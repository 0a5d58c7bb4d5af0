"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any, Dict, List

from pydantic import ConfigDict, Field, model_validator

from .chat import ChatMessage, ChatTemplateFields, template_rules
from .common import PromptTokenId, Strict


def _tokenize_rules(schema: Dict[str, Any], cls: type) -> None:
    template_rules(schema)
    # the schema states the rule _check_input enforces: a prompt, or messages
    null = {"type": "null"}
    schema["anyOf"] = [  # (the fields' own schemas name their types: see _assistant_rules)
        {"required": ["prompt"], "properties": {
            "prompt": {"not": null}, "messages": null, "add_generation_prompt": null,
            "continue_final_message": {"const": False}, "chat_template_kwargs": null, "tools": null}},
        {"required": ["messages"], "properties": {"prompt": null, "messages": {"not": null},
                                                  "add_special_tokens": null}},
    ]


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt as the tokenizer encodes it, or chat messages as the chat template renders them."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_tokenize_rules)
    model: str | None = Field(None, description="must name the served model when given")
    prompt: str | None = None
    messages: List[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="a prompt's: the tokenizer's own special tokens, "
                                                              "e.g. BOS (default true)")

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages")
        template = (self.add_generation_prompt, self.chat_template_kwargs, self.tools)
        if self.prompt is not None and (any(option is not None for option in template) or self.continue_final_message):
            raise ValueError("the chat template's options go with messages, not a prompt")
        if self.messages is not None and self.add_special_tokens is not None:
            raise ValueError("add_special_tokens goes with a prompt (the chat template writes the special tokens)")
        return self


class DetokenizeRequest(Strict):
    model: str | None = Field(None, description="must name the served model when given")
    tokens: List[PromptTokenId] = Field(description="ids within the vocabulary")
