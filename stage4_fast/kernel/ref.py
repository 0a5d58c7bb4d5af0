"""PyTorch references of the custom kernels: the CPU path, and the oracle the kernels are tested against."""

from __future__ import annotations

from typing import Tuple

import torch


def store_cache_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """Scatter per-token K/V rows into the caches at token slots ``indices`` (caches seen as [num_slots, -1])."""
    num_tokens = indices.shape[0]
    k_cache.view(k_cache.shape[0], -1)[indices] = k.reshape(num_tokens, -1)
    v_cache.view(v_cache.shape[0], -1)[indices] = v.reshape(num_tokens, -1)


def indexing_ref(weights: torch.Tensor, indices: torch.Tensor, output: torch.Tensor | None = None,
                 vocab_range: Tuple[int, int] | None = None) -> torch.Tensor:
    """Row gather; with ``vocab_range=(start, length)`` rows whose index lies outside [start, start+length) are
    zero and the others are read at ``index - start`` (one rank's shard of a vocab-parallel embedding)."""
    if vocab_range is None:
        result = weights[indices]
    else:
        start, length = vocab_range
        local = indices.long() - start
        inside = (local >= 0) & (local < length)
        result = weights[local.clamp(0, max(length - 1, 0))] * inside.unsqueeze(1).to(weights.dtype)
    if output is None:
        return result
    output.copy_(result)
    return output


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        table_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        sm_scale: float) -> torch.Tensor:
    """Causal attention of ragged queries against the token-slot paged cache, one request at a time in fp32.
    q [T, Hq, D]; k_cache/v_cache [num_slots, Hkv, D]; query i of request b sits at position
    ``seq_lens[b] - q_len_b + i``. Decode is the case q_len_b == 1."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for b, (row, seq_len) in enumerate(zip(table_idx.tolist(), seq_lens.tolist())):
        q_b = q[cu[b]:cu[b + 1]].float().transpose(0, 1)  # [Hq, L, D]
        q_len = q_b.shape[1]
        slots = page_table[row, :seq_len].long()
        k = k_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, S, D]
        v = v_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = (q_b @ k.transpose(1, 2)) * sm_scale
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        scores.masked_fill_(torch.arange(seq_len, device=q.device).unsqueeze(0) > pos_q, float("-inf"))
        out[cu[b]:cu[b + 1]] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def fused_experts_ref(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Expert MLPs the plain way (as HF's Qwen3MoeExperts): for each expert hit, its tokens through
    gate/up -> act(gate) * up -> down, scaled by the routing weight and summed per token."""
    act_fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        gate, up = torch.nn.functional.linear(hidden_states[token_idx], w1[expert]).chunk(2, dim=-1)
        down = torch.nn.functional.linear(act_fn(gate) * up, w2[expert])
        out.index_add_(0, token_idx, down * weights[token_idx, k_idx, None])
    return out
