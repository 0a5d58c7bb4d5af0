"""PyTorch references of the custom kernels: the CPU path, and the oracle the kernels are tested against."""

from __future__ import annotations

from typing import Tuple

import torch


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded to ``dtype`` (nearest even); fp8 saturates at its largest finite value (GPU satfinite)."""
    if x.dtype == dtype and scale == 1.0:
        return x
    y = x.float() / scale if scale != 1.0 else x.float()
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        y = y.clamp(-limit, limit)
    return y.to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return y * scale if scale != 1.0 else y


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # torch's scatter/gather kernels do not cover the fp8 dtypes everywhere; their bytes move as uint8
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return _as_bytes(cache)[slots].view(cache.dtype)


def store_cache_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter K/V rows into the caches (as [num_slots, -1]) at slots ``indices``, through ``quantize_kv``."""
    num_tokens = indices.shape[0]
    if num_tokens == 0:  # (as the CUDA kernel; a [0, -1] reshape would be ambiguous)
        return
    for cache, rows, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        stored = quantize_kv(rows.reshape(num_tokens, -1), scale, cache.dtype)
        _as_bytes(cache.view(cache.shape[0], -1))[indices] = _as_bytes(stored)


def indexing_ref(weights: torch.Tensor, indices: torch.Tensor, output: torch.Tensor | None = None,
                 vocab_range: Tuple[int, int] | None = None) -> torch.Tensor:
    """Row gather; with ``vocab_range=(start, length)`` (a shard) rows outside are zero, others ``index - start``."""
    if vocab_range is None:
        result = weights[indices]
    else:
        start, length = vocab_range
        local = indices.long() - start
        inside = (local >= 0) & (local < length)
        result = weights[local.clamp(0, max(length - 1, 0))] * inside.unsqueeze(1).to(weights.dtype)
    return result if output is None else output.copy_(result)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        table_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of ragged queries against the paged cache, per request in fp32. q [T, Hq, D]; k/v_cache
    [num_slots, Hkv, D] read as ``stored * scale``; query i of request b sits at ``seq_lens[b] - q_len_b + i``."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for b, (row, seq_len) in enumerate(zip(table_idx.tolist(), seq_lens.tolist())):
        q_b = q[cu[b]:cu[b + 1]].float().transpose(0, 1)  # [Hq, L, D]
        q_len = q_b.shape[1]
        slots = page_table[row, :seq_len].long()
        k = dequantize_kv(gather_rows(k_cache, slots), k_scale, torch.float32)
        v = dequantize_kv(gather_rows(v_cache, slots), v_scale, torch.float32)
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        scores = (q_b @ k.transpose(1, 2)) * sm_scale
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        scores.masked_fill_(torch.arange(seq_len, device=q.device).unsqueeze(0) > pos_q, float("-inf"))
        out[cu[b]:cu[b + 1]] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def fused_experts_ref(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Expert MLPs as HF's Qwen3MoeExperts: per expert, act(gate) * up -> down, weighted and summed per token."""
    act_fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        gate, up = torch.nn.functional.linear(hidden_states[token_idx], w1[expert]).chunk(2, dim=-1)
        down = torch.nn.functional.linear(act_fn(gate) * up, w2[expert])
        out.index_add_(0, token_idx, down * weights[token_idx, k_idx, None])
    return out
