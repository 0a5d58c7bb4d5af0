"""Custom kernels. ``store_cache`` and ``indexing`` run JIT-built CUDA on a GPU and the torch reference elsewhere;
the Triton kernels (attention, fused MoE) live in their own modules so importing this package never needs Triton."""

from __future__ import annotations

import os
from typing import Tuple

import torch

from .jit import load_cuda_kernels
from .ref import indexing_ref, is_fp8, store_cache_ref


def triton_interpreting() -> bool:
    """Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1): no launch options, no GPU-only features."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """K/V rows [L, ...] into the caches (as [num_slots, -1]) at distinct slots ``indices`` [L] (fp8: / scale)."""
    module = load_cuda_kernels() if k_cache.is_cuda else None
    if module is not None and k_cache.dtype == k.dtype:
        module.store_cache(k_cache, v_cache, indices, k, v)
    elif module is not None and is_fp8(k_cache.dtype):
        module.store_cache_fp8(k_cache, v_cache, indices, k, v, k_scale, v_scale)
    else:
        store_cache_ref(k_cache, v_cache, indices, k, v, k_scale, v_scale)


def indexing(weights: torch.Tensor, indices: torch.Tensor, *, output: torch.Tensor | None = None,
             vocab_range: Tuple[int, int] | None = None) -> torch.Tensor:
    """Embedding lookup ``weights[indices]``; with ``vocab_range=(start, length)`` out-of-range rows are zero."""
    module = load_cuda_kernels() if weights.is_cuda else None
    if module is None:
        return indexing_ref(weights, indices, output=output, vocab_range=vocab_range)
    if output is None:
        output = weights.new_empty(indices.shape[0], weights.shape[1])
    start, length = vocab_range if vocab_range is not None else (0, weights.shape[0])
    module.indexing(weights, indices, output, start, length)
    return output


def fused_kernels_for(x: torch.Tensor):
    """``triton_fused`` for a CUDA bf16/fp16 activation ``x``, else None (the PyTorch path)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    from . import triton_fused

    return triton_fused


def gemv_kernel_for(x: torch.Tensor):
    """``triton_gemv`` for a one-row CUDA bf16/fp16 activation ``x``, else None (F.linear)."""
    if x.dim() != 2 or x.shape[0] != 1 or not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    from . import triton_gemv

    return triton_gemv


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [rows, vocab] as int32 (the Triton kernel for CUDA bf16/fp16 logits)."""
    if (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16) and logits.dim() == 2
            and logits.stride(1) == 1):
        from . import triton_argmax

        return triton_argmax.argmax_rows(logits)
    return logits.argmax(dim=-1).to(torch.int32)


__all__ = ["fused_kernels_for", "triton_interpreting", "gemv_kernel_for", "greedy_argmax", "indexing",
           "load_cuda_kernels", "store_cache"]
