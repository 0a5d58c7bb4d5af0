"""Tools: the functions a chat request offers the model, an assistant turn's calls, a tool_choice that names one."""

from __future__ import annotations

from typing import Any, Dict, Literal

from pydantic import Field

from .common import Strict


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: Dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction
