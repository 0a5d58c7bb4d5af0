"""Tool calls: the model's output read back as OpenAI ``tool_calls``.

``"auto"``: ``--tool-call-parser`` finds Hermes' ``<tool_call>{...}</tool_call>`` blocks; ``"required"`` or a named
tool: a schema holds the output to JSON (vLLM's way). A stream sends each call once complete; a named tool's
arguments stream as they come."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from .protocol.chat import ChatCompletionRequest
from .protocol.common import APIError
from .protocol.tools import NamedToolChoice
from .tags import tag_start_len

# --tool-call-parser: vLLM's and SGLang's names of the one format parsed here
TOOL_CALL_PARSERS = ("hermes", "qwen25")
START, END = "<tool_call>", "</tool_call>"


def new_call(name: str, arguments: str) -> Dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _block_call(block: str) -> Dict[str, Any] | None:
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return new_call(data["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


@dataclass
class HermesStream:
    """One choice's text, piece by piece: what to show as content now, and the calls completed so far."""

    pending: str = ""  # text not shown yet: a possible START's beginning, or an open block
    calls: List[Dict[str, Any]] = field(default_factory=list)

    def feed(self, piece: str, final: bool = False) -> Tuple[str, List[Dict[str, Any]]]:
        text, shown, new_calls = self.pending + piece, [], []
        while (start := text.find(START)) >= 0 and (end := text.find(END, start + len(START))) >= 0:
            shown.append(text[:start])
            call = _block_call(text[start + len(START) : end].strip())
            if call is None:  # not a call after all: its text is content
                shown.append(text[start : end + len(END)])
            else:
                new_calls.append(call)
            text = text[end + len(END) :]
        # an open block, or what may start one, waits for more (at the end, an unfinished block is text)
        start = text.find(START)
        keep = 0 if final else len(text) - start if start >= 0 else tag_start_len(text, START)
        shown.append(text[: len(text) - keep])
        self.pending = text[len(text) - keep :]
        self.calls.extend(new_calls)
        return "".join(shown), new_calls


def parse_hermes(text: str) -> Tuple[str, List[Dict[str, Any]]]:
    return HermesStream().feed(text, final=True)


def forced_schema(tools: List[Dict[str, Any]], name: str | None, parallel: bool = True) -> Dict[str, Any]:
    """The JSON the output is held to: a named tool's arguments, or (required) a list of calls (one unless parallel)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if name is not None:
        return params[name]
    calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": n}, "arguments": p}} for n, p in params.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def forced_calls(text: str, name: str | None) -> List[Dict[str, Any]]:
    """The calls of an output held to ``forced_schema`` (a list cut short does not parse and gives none)."""
    if name is not None:
        return [new_call(name, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                              for item in items):
        return []  # (the grammar allows nothing else; a broken one must not cost the request its reply)
    return [new_call(item["name"], json.dumps(item.get("arguments", {}))) for item in items]


class ToolCallReader:
    """A chat request's choices read for tool calls, ``"auto"`` (Hermes) or ``"forced"``, streamed ones' state."""

    def __init__(self, mode: str, name: str | None = None, parallel: bool = True) -> None:
        self.mode, self.name, self.parallel = mode, name, parallel
        self.streams: Dict[int, HermesStream] = {}
        self.held: Dict[int, str] = {}  # a forced choice's output so far
        self.emitted: Dict[int, int] = {}  # calls streamed per choice

    def whole(self, text: str, finish: str | None) -> Tuple[str | None, List[Dict[str, Any]], str | None]:
        """A finished choice: (content, calls, finish_reason)."""
        if self.mode == "auto":
            content, calls = parse_hermes(text)
            calls = calls if self.parallel else calls[:1]
        else:
            calls = forced_calls(text, self.name)
            content = "" if calls else text
        return (content or None, calls, "tool_calls" if calls and finish == "stop" else finish)

    def piece(self, index: int, text: str, finish: str | None) -> Tuple[str, List[Dict[str, Any]], str | None]:
        """A streamed delta of choice ``index``: (content to show, new calls with their ``index``, finish_reason)."""
        if self.mode == "auto":
            content, calls = self.streams.setdefault(index, HermesStream()).feed(text, final=finish is not None)
            if not self.parallel:
                calls = calls[: max(0, 1 - self.emitted.get(index, 0))]
        elif self.name is not None:  # a named tool: the output is its arguments, streamed as they come
            if self.emitted.get(index):
                pieces = [{"index": 0, "function": {"arguments": text}}] if text else []
                return "", pieces, "tool_calls" if finish == "stop" else finish
            content, calls = "", [new_call(self.name, text)]
        else:
            self.held[index] = self.held.get(index, "") + text
            content, calls = "", []
            if finish is not None:
                calls = forced_calls(self.held[index], self.name)
                content = "" if calls else self.held[index]
        first = self.emitted.get(index, 0)
        self.emitted[index] = first + len(calls)
        if finish == "stop" and self.emitted[index]:
            finish = "tool_calls"
        return content, [{"index": first + k, **call} for k, call in enumerate(calls)], finish


def tool_call_reader(req: ChatCompletionRequest, parser: str | None
                     ) -> Tuple[ToolCallReader | None, Dict[str, str] | None]:
    """The request's tool call reader (None: none) and the grammar a forced call needs (None: the request's own)."""
    mode = req.effective_tool_choice()
    if mode == "none":
        return None, None
    if mode == "auto":
        if parser is None:
            raise APIError(400, "tool_choice auto (the default with tools) needs a server started with "
                           "--tool-call-parser; send none, required or a named tool", "invalid_value", "tool_choice")
        return ToolCallReader("auto", parallel=req.parallel_tool_calls), None
    name = mode.function.name if isinstance(mode, NamedToolChoice) else None
    return (ToolCallReader("forced", name),
            {"json_schema": json.dumps(forced_schema(req.tool_dicts(), name, req.parallel_tool_calls))})
