"""Reference attention in plain PyTorch over the paged KV pool.

Decode attends one query per request against its own keys (padded to the longest), prefill request by request
with SDPA; index tensors (slots, masks) are built once per forward in prepare_metadata, not per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch
import torch.nn.functional as F

from ..core import get_global_ctx
from .base import BaseAttnBackend, BaseAttnMetadata

if TYPE_CHECKING:
    from ..core import Batch
    from ..models import ModelConfig


@dataclass
class PrefillSegment:
    q_start: int
    q_end: int
    kv_indices: torch.Tensor  # [device_len] token slots, int64
    mask: torch.Tensor | None  # [extend_len, device_len] bool when a cached prefix exists; None: plain causal


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    out_loc: torch.Tensor  # int64 copy of batch.out_loc (indexing wants int64; convert once, not per layer)
    last_indices: torch.Tensor  # [padded bs] int64
    is_decode: bool  # every request has exactly one query token
    kv_indices: torch.Tensor | None = None  # decode: [bs, max_len] slots, padded with each request's slot 0
    kv_mask: torch.Tensor | None = None  # decode: [bs, 1, 1, max_len] bool, None when all lengths are equal
    segments: List[PrefillSegment] | None = None  # prefill: one per request

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.last_indices[:bs]


class TorchBackend(BaseAttnBackend):
    def __init__(self, config: ModelConfig):
        ctx = get_global_ctx()
        self.kv_cache = ctx.kv_cache  # the pool must exist before the backend, as upstream
        self.page_table = ctx.page_table
        self.scale = config.head_dim**-0.5
        num_layers = self.kv_cache.num_layers
        k0 = self.kv_cache.k_cache(0)
        self.num_kv_heads, self.head_dim = k0.shape[-2], k0.shape[-1]
        # per-layer [num_slots, heads * dim] views, made once: index_select on a 2-D view is several times faster
        # on CPU than advanced indexing of [num_slots, heads, dim] (stage1), and decode gathers in every layer
        self._k = [self.kv_cache.k_cache(i).view(-1, self.num_kv_heads * self.head_dim) for i in range(num_layers)]
        self._v = [self.kv_cache.v_cache(i).view(-1, self.num_kv_heads * self.head_dim) for i in range(num_layers)]

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        device = self.page_table.device
        extend = [r.extend_len for r in reqs]
        cu_q = torch.tensor([0] + extend, dtype=torch.int64).cumsum(0)
        common = dict(out_loc=batch.out_loc.to(torch.int64), last_indices=(cu_q[1:] - 1).to(device))
        if max(extend) == 1:
            lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int64, device=device)
            rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)
            max_len = int(max(r.device_len for r in reqs))
            kv_indices = self.page_table[rows, :max_len].to(torch.int64)
            valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            # Padding points at the request's own first slot: written, so finite (a 0 weight times garbage
            # could be NaN).
            kv_indices = torch.where(valid, kv_indices, kv_indices[:, :1])
            same = all(r.device_len == max_len for r in reqs)
            mask = None if same else valid[:, None, None, :]
            batch.attn_metadata = TorchAttnMetadata(**common, is_decode=True, kv_indices=kv_indices, kv_mask=mask)
            return
        segments = []
        for req, start, end in zip(reqs, cu_q[:-1].tolist(), cu_q[1:].tolist()):
            kv_indices = self.page_table[req.table_idx, : req.device_len].to(torch.int64)
            mask = None
            if req.cached_len > 0:  # query i sits at position cached_len + i and sees keys 0..cached_len + i
                q_pos = torch.arange(req.cached_len, req.device_len, device=device)
                mask = torch.arange(req.device_len, device=device)[None, :] <= q_pos[:, None]
            segments.append(PrefillSegment(start, end, kv_indices, mask))
        batch.attn_metadata = TorchAttnMetadata(**common, is_decode=False, segments=segments)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata  # type: ignore[assignment]
        self.kv_cache.store_kv(k, v, meta.out_loc, layer_id)
        k_slots, v_slots = self._k[layer_id], self._v[layer_id]
        if meta.is_decode:
            return self._decode(q, k_slots, v_slots, meta)
        out = torch.empty_like(q)
        for seg in meta.segments or []:
            qi = q[seg.q_start : seg.q_end].transpose(0, 1)[None]  # [1, Hq, ext, D]
            ki = self._gather(k_slots, seg.kv_indices).transpose(0, 1)[None]  # [1, Hkv, S, D]
            vi = self._gather(v_slots, seg.kv_indices).transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=seg.mask, is_causal=seg.mask is None,
                                                scale=self.scale, enable_gqa=True)
            out[seg.q_start : seg.q_end] = oi[0].transpose(0, 1)
        return out

    def _gather(self, slots: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` (any shape) of a [num_slots, heads * dim] view, as [*indices.shape, heads, dim]."""
        rows = slots.index_select(0, indices.reshape(-1))
        return rows.view(*indices.shape, self.num_kv_heads, self.head_dim)

    def _decode(
        self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, meta: TorchAttnMetadata
    ) -> torch.Tensor:
        bs, num_qo_heads, head_dim = q.shape
        group = num_qo_heads // self.num_kv_heads
        # GQA without repeating K/V: q head h uses kv head h // group, so a group's heads are rows of one query
        qg = q.view(bs, self.num_kv_heads, group, head_dim)
        kb = self._gather(k_slots, meta.kv_indices).transpose(1, 2)  # [bs, Hkv, S, D]
        vb = self._gather(v_slots, meta.kv_indices).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=meta.kv_mask, scale=self.scale)
        return o.reshape(bs, num_qo_heads, head_dim)  # SDPA output may be strided (CUDA)
