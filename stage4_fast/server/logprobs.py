"""Logprobs in OpenAI's two shapes: the legacy one of /v1/completions (parallel lists) and chat's."""

from __future__ import annotations

from typing import Any, Dict, List

from ..message import TextLogprobs


def _top_dict(tokens: List[str], values: List[float]) -> Dict[str, float]:
    top: Dict[str, float] = {}
    for token, value in zip(tokens, values):  # two ids with the same text: keep the likelier (listed first)
        top.setdefault(token, value)
    return top


class CompletionLogprobs:
    """The legacy shape, one run at a time; ``text_offset`` counts from the choice's start, echoed prompt included."""

    def __init__(self) -> None:
        self.offset = 0

    def format(self, *runs: TextLogprobs | None) -> Dict[str, Any]:
        out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for run in filter(None, runs):
            for token, value, top_tokens, top_values in zip(run.tokens, run.logprobs, run.top_tokens, run.top_logprobs):
                out["tokens"].append(token)
                out["token_logprobs"].append(value)
                # the echoed prompt's first token: nothing predicts it, so no logprob and no alternatives
                out["top_logprobs"].append(None if value is None else _top_dict(top_tokens, top_values))
                out["text_offset"].append(self.offset)
                self.offset += len(token)
        return out


def _token_entry(token: str, value: float) -> Dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(run: TextLogprobs | None) -> Dict[str, Any]:
    content = []
    if run is not None:
        for token, value, top_tokens, top_values in zip(run.tokens, run.logprobs, run.top_tokens, run.top_logprobs):
            assert value is not None  # only an echoed prompt's first token has none
            entry = _token_entry(token, value)
            entry["top_logprobs"] = [_token_entry(t, v) for t, v in zip(top_tokens, top_values)]
            content.append(entry)
    return {"content": content}
