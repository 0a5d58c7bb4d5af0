"""/v1/completions and upstream's /generate."""

from __future__ import annotations

from typing import ClassVar, Dict, List, Mapping

from pydantic import Field, model_validator

from .common import MAX_CHOICES, NI, MaxTokens, NotImplementedField, Prompt, SinglePrompt, Strict, TopLogprobs
from .sampling import NOT_IMPLEMENTED_SAMPLING, SamplingFields

NOT_IMPLEMENTED_COMPLETION: Dict[str, NotImplementedField] = {
    **NOT_IMPLEMENTED_SAMPLING,
    "best_of": NI((1,), "best-of sampling"),
    "suffix": NI((), "insertion"),
}


class CompletionRequest(SamplingFields):
    not_implemented: ClassVar[Mapping[str, NotImplementedField]] = NOT_IMPLEMENTED_COMPLETION
    prompt: Prompt = Field(description="text or token ids, or a list of prompts (each gets n choices, in order; n "
                                       f"times their number is at most {MAX_CHOICES})")
    max_tokens: MaxTokens | None = 16
    echo: bool = Field(False, description="the prompt comes back in front of the output (and in the logprobs)")
    logprobs: TopLogprobs | None = Field(None, description="the logprob of every token and of this many likeliest")

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"n times the number of prompts must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> List[str | List[int]]:
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class GenerateRequest(Strict):
    """Upstream's /generate: greedy, streamed."""

    prompt: SinglePrompt
    max_tokens: MaxTokens
    ignore_eos: bool = False
    stream: bool = True
