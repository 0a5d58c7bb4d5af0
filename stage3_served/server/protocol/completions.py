"""/v1/completions and upstream's /generate."""

from __future__ import annotations

from typing import ClassVar, Dict, Mapping

from pydantic import Field, model_validator

from .common import NI, MaxTokens, NotImplementedField, Prompt, SinglePrompt, Strict
from .sampling import NOT_IMPLEMENTED_SAMPLING, SamplingFields

NOT_IMPLEMENTED_COMPLETION: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
    "logprobs": NI((0,), "log probabilities"),
    "echo": NI((False,), "echoing the prompt"),
    "best_of": NI((1,), "best-of sampling"),
    "suffix": NI((), "insertion"),
}


class CompletionRequest(SamplingFields):
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_COMPLETION
    prompt: Prompt = Field(description="text or token ids; a list of one prompt is accepted (no batching)")
    max_tokens: MaxTokens | None = 16

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            self.prompt = self.prompt[0]  # the list of one prompt
        return self


class GenerateRequest(Strict):
    """Upstream's /generate: greedy, streamed."""

    prompt: SinglePrompt
    max_tokens: MaxTokens
    ignore_eos: bool = False
    stream: bool = True
