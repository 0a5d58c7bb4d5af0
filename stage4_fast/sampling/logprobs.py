"""Logprobs of the sampled tokens, their top alternatives and the prompt (echo): ``log_softmax`` of the raw fp32
logits, before temperature, penalties, bias or grammar mask (vLLM's "raw logprobs", what evaluations read)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, List, Tuple

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM's default max_logprobs too)
PROMPT_LOGITS_CHUNK = 256  # prompt rows per logits chunk: a long prompt's logits need not fit at once


@dataclass
class LogprobArgs:
    """Which rows of a batch report logprobs (built by ``Sampler.prepare``)."""

    rows: torch.Tensor  # [m] device int64: batch rows whose sampled token's logprob is reported
    rows_host: List[int]
    top_k: int  # the largest count of alternatives asked in the batch; each request keeps its own first ones
    # echo: the prefill's token rows whose logits predict a prompt token, and where that token is in the pool
    prompt_rows: torch.Tensor | None = None  # [p] device int64
    prompt_targets: Tuple[torch.Tensor, torch.Tensor] | None = None  # (pool row, position), [p] each
    prompt_segments: List[Tuple[int, int, int]] | None = None  # (batch row, first of its prompt rows, count)


@dataclass
class BatchLogprobs:
    """A batch's logprobs: device tensors, then (``to_host``) their host copies."""

    token_logprobs: torch.Tensor  # [m] fp32, one per LogprobArgs.rows
    top_ids: torch.Tensor  # [m, top_k] int32, most likely first
    top_logprobs: torch.Tensor  # [m, top_k] fp32
    prompt_token_logprobs: torch.Tensor | None = None  # [p], one per LogprobArgs.prompt_rows
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None

    def to_host(self) -> BatchLogprobs:  # non-blocking: valid once the batch's copy event has completed
        return BatchLogprobs(**{f.name: None if (t := getattr(self, f.name)) is None else t.to("cpu", non_blocking=True)
                                for f in fields(self)})


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, ...]:
    """(logprob of each row's target, ids and logprobs of each row's top_k tokens) from raw logits [n, V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, targets.long()[:, None]).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)  # top_k may be 0: empty [n, 0]
    return chosen, top_ids.to(torch.int32), top_logprobs


def compute_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor, args: LogprobArgs,
                     token_pool: torch.Tensor | None = None, prompt_hidden: torch.Tensor | None = None,
                     compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> BatchLogprobs:
    """The sampled tokens' logprobs; with echo, also the prompt's, from kept hidden states a chunk at a time."""
    out = BatchLogprobs(*logprobs_of(logits[args.rows], next_tokens[args.rows], args.top_k))
    if args.prompt_rows is not None:
        assert token_pool is not None and prompt_hidden is not None and compute_logits is not None
        assert args.prompt_targets is not None
        targets = token_pool[args.prompt_targets]
        parts = [logprobs_of(compute_logits(prompt_hidden[s : s + PROMPT_LOGITS_CHUNK]),
                             targets[s : s + PROMPT_LOGITS_CHUNK], args.top_k)
                 for s in range(0, len(targets), PROMPT_LOGITS_CHUNK)]
        out.prompt_token_logprobs, out.prompt_top_ids, out.prompt_top_logprobs = (torch.cat([p[i] for p in parts])
                                                                                   for i in range(3))
    return out
