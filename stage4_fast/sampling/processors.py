"""Batched logit processors of the OpenAI / vLLM sampling fields. Sampler order, as vLLM's: bias and penalties on
raw logits (they steer greedy too), grammar mask, then temperature, min-p, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitBiasArgs:
    """Every (batch row, token id, bias) of the batch's requests that set ``logit_bias``."""

    rows: torch.Tensor  # [n] device int64
    token_ids: torch.Tensor  # [n] device int64
    biases: torch.Tensor  # [n] device fp32


def apply_logit_bias(logits: torch.Tensor, args: LogitBiasArgs) -> None:
    """In place: ``logits[row, id] += bias`` (OpenAI's logit_bias, added before anything else)."""
    logits.index_put_((args.rows, args.token_ids), args.biases.to(logits.dtype), accumulate=True)


@dataclass
class PenaltyArgs:
    """Penalised rows and their token-pool spans, read at sampling time: under overlap the host lacks the last token."""

    rows: torch.Tensor  # [m] device int64: rows of the batch
    presence: torch.Tensor  # [m] fp32
    frequency: torch.Tensor  # [m] fp32
    repetition: torch.Tensor  # [m] fp32
    pool_rows: torch.Tensor  # [m] device int64: each row's token-pool row
    starts: torch.Tensor  # [m] device int64: the first position read (0, or the prompt's end)
    lengths: torch.Tensor  # [m] device int64: how many positions are read
    prompt_lens: torch.Tensor  # [m] device int64: positions from here on are generated tokens
    max_length: int  # the largest length (the width of the [m, L] reads, built on the device)


def apply_penalties(logits: torch.Tensor, token_pool: torch.Tensor, args: PenaltyArgs) -> None:
    """In place, vLLM's formulas: a seen token's logit is divided (positive) or multiplied (negative) by the
    repetition penalty; then ``frequency * output count`` and ``presence * (count > 0)`` are subtracted."""
    vocab, m = logits.shape[-1], len(args.rows)
    # the [m, L] positions are built on the device from four [m] vectors (no per-step host copies)
    offsets = torch.arange(args.max_length, device=logits.device)[None, :]
    is_seen = offsets < args.lengths[:, None]  # a prompt or generated token, not padding
    positions = torch.where(is_seen, args.starts[:, None] + offsets, 0)
    is_output = is_seen & (positions >= args.prompt_lens[:, None])  # counted by presence / frequency
    # padding reads id `vocab`: an extra column, cut off below
    ids = torch.where(is_seen, token_pool[args.pool_rows[:, None], positions].long(), vocab)
    counts = torch.zeros(m, vocab + 1, dtype=torch.float32, device=logits.device)
    counts = counts.scatter_add_(1, ids, is_output.float())[:, :vocab]
    seen = torch.zeros(m, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, ids, True)[:, :vocab]
    x = logits[args.rows].float()
    rep = args.repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - args.frequency[:, None] * counts - args.presence[:, None] * (counts > 0).float()
    logits[args.rows] = x.to(logits.dtype)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero probabilities below ``min_p`` x the row's largest; the caller renormalises."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)
