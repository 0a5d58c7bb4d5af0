"""Tags in streamed text (``<tool_call>``, ``</think>``, stop strings): what a reader holds back while one may start."""

from __future__ import annotations


def tag_start_len(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (held back until the next piece says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
