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
