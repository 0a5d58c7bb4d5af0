"""The sampling fields /v1/completions and /v1/chat/completions share."""

from __future__ import annotations

from typing import Dict, List

from pydantic import Field

from .common import NI, Int32, MaxTokens, NotImplementedField, SafeInt, Stop, Strict

# what both completion endpoints know but do not implement
NOT_IMPLEMENTED_SAMPLING: Dict[str, NotImplementedField] = {
    "n": NI((1,), "several choices per request"),
    "presence_penalty": NI((0,), "presence penalty"),
    "frequency_penalty": NI((0,), "frequency penalty"),
    "repetition_penalty": NI((1,), "repetition penalty"),
    "min_p": NI((0,), "min-p sampling"),
    "min_tokens": NI((0,), "a minimum output length"),
    "logit_bias": NI(({},), "logit bias"),
    "response_format": NI(({"type": "text"},), "structured output"),
    "user": NI((), "per-user tracking"),
    # vLLM / SGLang extras
    "include_stop_str_in_output": NI((False,), "keeping the stop string"),
    "regex": NI((), "constrained decoding"),
    "json_schema": NI((), "constrained decoding"),
    "ebnf": NI((), "constrained decoding"),
}


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: MaxTokens | None = Field(None, description="new tokens at most (default: the rest of the context)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int32 = Field(-1, description="< 1 disables top-k")
    seed: SafeInt | None = Field(None, description="per-request sampling seed")
    stop: Stop | None = Field(None, description="the text is cut before the first occurrence")
    stop_token_ids: List[Int32] | None = Field(None, description="token ids that end the request like EOS")
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="leave special tokens (e.g. <|im_end|>) out of the text")
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> List[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
