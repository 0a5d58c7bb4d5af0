"""Reference formulas for the production API's tests, written token by token from vLLM's documented semantics."""

from __future__ import annotations

from pathlib import Path
from typing import List

import torch

from stage4_fast.core import SamplingParams

from .conftest import hf_logits


def reference_penalties(logits: torch.Tensor, prompt: List[int], output: List[int], p: SamplingParams) -> torch.Tensor:
    """One row of logits after vLLM's penalties: a token seen in the prompt or the output is divided by the
    repetition penalty when positive, multiplied when negative; a token of the output loses frequency * its count
    + presence."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def hf_logprobs(path: Path | str, ids: List[int]) -> torch.Tensor:
    """log_softmax of HF's fp32 logits at every position (in float64)."""
    return torch.log_softmax(hf_logits(Path(path), ids).double(), dim=-1)


def hf_greedy_with_penalties(path: Path | str, prompt: List[int], n: int, p: SamplingParams) -> List[int]:
    """Greedy decoding with HF's logits and the reference penalties and logit bias."""
    output: List[int] = []
    for _ in range(n):
        logits = hf_logits(Path(path), prompt + output)[-1].double()
        for token_id, bias in p.logit_bias:
            logits[token_id] += bias
        output.append(int(reference_penalties(logits, prompt, output, p).argmax()))
    return output
