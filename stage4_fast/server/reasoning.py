"""A thinking model's ``<think>...</think>`` block read out into ``reasoning_content`` (``--reasoning-parser``).

``qwen3``: an output that does not start with ``<think>`` is all content. ``deepseek-r1``: the template opens the
block in the prompt (a ``<think>`` the model writes anyway is dropped). The block runs to ``</think>`` or to the end
of an output cut short (a stream cannot take back what it sent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from .tags import tag_start_len

REASONING_PARSERS = ("qwen3", "deepseek-r1", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass
class ReasoningStream:
    """One choice's text, piece by piece; ``stream_reasoning`` false sends the reasoning whole when the block ends."""

    parser: str
    stream_reasoning: bool = True
    state: str = "start"  # start (qwen3: is there a block?), inside, after
    pending: str = ""  # text not placed yet: a possible tag's beginning
    held: List[str] = field(default_factory=list)  # reasoning kept back (stream_reasoning false)

    def __post_init__(self) -> None:
        self._drop_start = self.parser != "qwen3"  # deepseek-r1: a <think> the model writes anyway
        if self._drop_start:
            self.state = "inside"

    def feed(self, piece: str, final: bool = False) -> Tuple[str, str]:
        text, reasoning, content = self.pending + piece, "", ""
        self.pending = ""
        if self.state == "start" or self._drop_start:
            stripped = text.lstrip()
            if stripped.startswith(START):
                text = stripped[len(START):]
                self.state, self._drop_start = "inside", False
            elif START.startswith(stripped) and not final:
                self.pending = text  # (blank, or the tag's beginning so far)
                return self._out("", "", final)
            else:
                self._drop_start = False
                if self.state == "start":
                    self.state = "after"
        if self.state == "inside":
            end = text.find(END)
            if end >= 0:
                reasoning, text = text[:end], text[end + len(END):]
                self.state = "after"
            else:
                keep = 0 if final else tag_start_len(text, END)
                reasoning, self.pending = text[: len(text) - keep], text[len(text) - keep:]
                text = ""
        if self.state == "after":
            content = text
        return self._out(reasoning, content, final)

    def _out(self, reasoning: str, content: str, final: bool) -> Tuple[str, str]:
        if self.stream_reasoning:
            return reasoning, content
        self.held.append(reasoning)
        if self.state == "after" or final:
            whole, self.held = "".join(self.held), []
            return whole, content
        return "", content


def split_reasoning(parser: str, text: str) -> Tuple[str | None, str]:
    """A whole output: (reasoning, content); reasoning None when the output has no block (or an empty one)."""
    reasoning, content = ReasoningStream(parser).feed(text, final=True)
    return reasoning or None, content
