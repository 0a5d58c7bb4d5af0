"""OpenAI-compatible request models and errors.

The models are strict (``"16"`` is not an int, ``1`` is not a bool) and their bounds are in the schema, so
FastAPI's OpenAPI document says exactly what is accepted. Everything that fails validation becomes an OpenAI-style
error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (see ``api_server``).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An error the client caused (4xx) or a server that cannot answer now (503)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: Dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers or {}  # e.g. Retry-After on a 503

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Integers cross process boundaries as msgpack int64 / torch int32: out-of-range ones must be refused here, not by
# an encoder half-way through a request (found by the schema fuzzer).
# (int32 on the wire; negative ones and ones beyond the vocabulary get the scheduler's own 400)
TokenId = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Strict(BaseModel):
    # unknown fields are ignored (clients send many); the ones we know are type-checked strictly
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | List[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1,
                                   description="new tokens at most; at most the context length")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-(2**31), le=2**31 - 1, description="< 1 disables top-k")
    seed: Int64 | None = Field(None, description="per-request sampling seed")
    stop: str | List[str] | None = Field(None, description="the text is cut before the first occurrence")
    stop_token_ids: List[TokenId] | None = Field(None, description="token ids that end the request like EOS")
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted only at their neutral values: we would rather refuse than silently ignore them (upstream did)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: only 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: only 0")
    logprobs: bool | int | None = Field(None, description="not supported")

    @model_validator(mode="after")
    def _check(self) -> SamplingFields:
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if any(s == "" for s in self.stop_list()):
            raise ValueError("stop strings must not be empty")
        return self

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="newer name of max_tokens")


class CompletionRequest(SamplingFields):
    prompt: str | List[TokenId] | List[str] | List[List[TokenId]] = Field(
        description="text or token ids; a list of one prompt is accepted (no batching)"
    )
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    echo: bool = Field(False, description="not supported")

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = p = p[0]
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
        return self


class GenerateRequest(_Strict):
    """Upstream's /generate: greedy, streamed."""

    prompt: str | List[TokenId] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    ignore_eos: bool = False
    stream: bool = True


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
