"""Tags in streamed text (``<tool_call>``, ``</think>``): what a reader must hold back while a tag may be starting."""

from __future__ import annotations


def tag_start_len(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``: a stream that looks for the tag holds them back
    until the next piece says."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
