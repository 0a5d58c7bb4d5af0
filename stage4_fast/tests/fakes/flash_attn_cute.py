"""Fake ``flash_attn.cute`` (flash-attn-4): ``flash_attn_varlen_func`` with a paged KV cache."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .attention_math import causal_attention

calls: List[Dict[str, Any]] = []


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, min_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
    gather_kv_indices: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False,
    window_size: Tuple[int | None, int | None] = (None, None), learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0, num_splits: int = 1, pack_gqa: bool | None = None, deterministic: bool = False,
    return_lse: bool = False, **kwargs: Any,
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    assert page_table is not None, "the fake implements the paged form only"
    assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert cu_seqlens_q is not None and seqused_k is not None
    num_pages, page_size, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and q.shape[-1] == head_dim and q.shape[1] % num_kv_heads == 0
    batch = page_table.shape[0]
    assert cu_seqlens_q.shape == (batch + 1,) and seqused_k.shape == (batch,)
    calls.append(dict(page_size=page_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, batch=batch))
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b in range(batch):
        kv_len = int(seqused_k[b])
        pages = page_table[b, : -(-kv_len // page_size)].long()
        assert int(pages.max()) < num_pages
        kb = k[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        vb = v[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        assert max_seqlen_q is None or e - s <= max_seqlen_q
        out[s:e] = causal_attention(q[s:e], kb, vb, scale, causal)
    return out, None
