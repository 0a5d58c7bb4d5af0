"""Batched sampling: every request has its own temperature / top-k / top-p, all handled in one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

from ..core import GREEDY_TEMPERATURE
from ..utils.device import to_device

if TYPE_CHECKING:
    from ..core import Batch


@dataclass
class BatchSamplingArgs:
    temperatures: torch.Tensor | None  # [bs] float32; None: the whole batch is greedy; 0 marks a greedy request
    top_k: torch.Tensor | None = None  # [bs] int64 (vocab size = no limit); None: no request limits it
    top_p: torch.Tensor | None = None  # [bs] float32 in (0, 1]; None: no request limits it


def make_device_tensor(data: List, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(data, dtype=dtype), device)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero everything outside each row's top-k, then outside its top-p nucleus (of the top-k), and renormalise."""
    if top_k is None and top_p is None:
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    if top_k is not None:
        sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    if top_p is not None:
        mass_before = (sorted_probs.cumsum(-1) - sorted_probs) / sorted_probs.sum(-1, keepdim=True)
        # keep a token while the mass of the more likely ones is still short of top_p (the top token always stays)
        sorted_probs = sorted_probs.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_impl(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, generator: torch.Generator | None = None) -> torch.Tensor:
    greedy = temperatures < GREEDY_TEMPERATURE
    # Upstream gives greedy requests temperature 1e-6, which is greedy only up to near-ties; we take the argmax.
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    probs = filter_probs(probs, top_k, top_p)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int, seed: int = 42) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        params = [req.sampling_params for req in batch.reqs]
        if all(p.is_greedy for p in params):
            return BatchSamplingArgs(temperatures=None)
        temperatures = [0.0 if p.is_greedy else p.temperature for p in params]
        args = BatchSamplingArgs(make_device_tensor(temperatures, torch.float32, self.device))
        if any(p.top_k >= 1 for p in params):
            top_k = [p.top_k if p.top_k >= 1 else self.vocab_size for p in params]
            args.top_k = make_device_tensor(top_k, torch.int64, self.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = [min(max(p.top_p, 1e-6), 1.0) for p in params]
            args.top_p = make_device_tensor(top_p, torch.float32, self.device)
        return args

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        if args.temperatures is None:
            return logits.argmax(dim=-1)
        return sample_impl(logits, args.temperatures, args.top_k, args.top_p, self.generator)
