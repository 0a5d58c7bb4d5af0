"""The sampling fields /v1/completions and /v1/chat/completions share."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from pydantic import ConfigDict, Field

from .common import (
    NI,
    Bias,
    BiasedTokenId,
    Choices,
    Int32,
    MaxTokens,
    MinTokens,
    NotImplementedField,
    SafeInt,
    Stop,
    Strict,
    add_not_implemented,
)
from .structured import StructuredOutputFields

# what both completion endpoints know but do not implement
NOT_IMPLEMENTED_SAMPLING: Dict[str, NotImplementedField] = {
    # SGLang's router adds these to every request at these values
    "no_stop_trim": NI((False,), "keeping the stop string"),
    "return_hidden_states": NI((False,), "hidden states in the response"),
}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk has its usage so far")


def sampling_request_rules(schema: Dict[str, Any], cls: type) -> None:
    add_not_implemented(schema, cls)
    # pydantic writes a dict with a key pattern as patternProperties alone, which lets any other key through
    next(s for s in schema["properties"]["logit_bias"]["anyOf"] if s.get("type") == "object")[
        "additionalProperties"] = False
    # left out: at most one of STRUCTURED_OUTPUT_FIELDS (schemathesis cannot generate for it; the descriptions say it)


class SamplingFields(StructuredOutputFields):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=sampling_request_rules)

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: MaxTokens | None = Field(None, description="new tokens at most (default: the rest of the context)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int32 = Field(-1, description="< 1 disables top-k")
    seed: SafeInt | None = Field(None, description="per-request sampling seed")
    stop: Stop | None = Field(None, description="the text is cut before the first occurrence")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string")
    min_tokens: MinTokens = Field(0, description="vLLM extension: no stop before this many tokens")
    stop_token_ids: List[Int32] | None = Field(None, description="token ids that end the request like EOS")
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="leave special tokens (e.g. <|im_end|>) out of the text")
    user: str | None = Field(None, description="the client's end-user id, for the request log")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the production API (vLLM's semantics where OpenAI says nothing)
    n: Choices = Field(1, description="samples per prompt; with a seed, sample j uses seed + j")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # (far below 0.01, float32 would overflow dividing by it)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="vLLM / SGLang extension; 1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM / SGLang extension; 0 = off")
    logit_bias: Dict[BiasedTokenId, Bias] | None = Field(None, description="token id (a string) -> bias to its logit")

    def logit_bias_list(self) -> List[Tuple[int, float]]:
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    def stop_list(self) -> List[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
