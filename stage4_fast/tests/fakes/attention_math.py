from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]; causal aligned to the end (query i sits at S - L + i), the
    convention of both libraries."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().transpose(0, 1).repeat_interleave(group, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(group, 0)
    scores = qf @ kf.transpose(1, 2) * scale
    if causal:
        L, S = q.shape[0], k.shape[0]
        pos_q = torch.arange(S - L, S).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(S).unsqueeze(0) > pos_q, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)
