"""The paged attention oracle the attention kernels and backends are tested against."""

from __future__ import annotations

import torch

from stage4_fast.kernel.ref import _as_bytes, dequantize_kv


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return _as_bytes(cache)[slots].view(cache.dtype)


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
