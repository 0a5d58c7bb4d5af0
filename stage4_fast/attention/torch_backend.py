"""Reference attention in plain PyTorch over the paged KV pool.

Decode attends one query per request against its own keys (padded to the longest), prefill request by request
with SDPA; index tensors (slots, masks) are built once per forward in prepare_metadata, not per layer.
A pool of another dtype (``--kv-cache-dtype``) is dequantized on read (``kernel/ref.dequantize_kv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch
import torch.nn.functional as F

from ..core import get_global_ctx
from ..kernel.ref import dequantize_kv, is_fp8
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
    graph: TorchCaptureData | None = None  # captured decode: rows and lengths live in these buffers

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.last_indices[:bs]


@dataclass
class TorchCaptureData:
    """CPU graph emulation: a captured decode rebuilds its slot indices from these fixed buffers in every layer."""

    table_idx: torch.Tensor  # [bs] page-table rows
    seq_lens: torch.Tensor  # [bs] device lengths


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
        # on CPU than advanced indexing (stage1); an fp8 pool's rows are gathered as bytes (index_select lacks fp8)
        row = self.num_kv_heads * self.head_dim
        self._bytes = is_fp8(self.kv_cache.dtype)
        as_rows = (lambda t: t.view(torch.uint8).view(-1, row)) if self._bytes else (lambda t: t.view(-1, row))
        self._k = [as_rows(self.kv_cache.k_cache(i)) for i in range(num_layers)]
        self._v = [as_rows(self.kv_cache.v_cache(i)) for i in range(num_layers)]
        self.capture: TorchCaptureData | None = None

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        device = self.page_table.device
        extend = [r.extend_len for r in reqs]
        cu_q = torch.tensor([0] + extend, dtype=torch.int64).cumsum(0)
        common = dict(out_loc=batch.out_loc.to(torch.int64), last_indices=(cu_q[1:] - 1).to(device))
        if max(extend) == 1:
            lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int64, device=device)
            rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)
            kv_indices, mask = self._decode_indices(rows, lens, int(max(r.device_len for r in reqs)))
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

    def _decode_indices(self, rows: torch.Tensor, lens: torch.Tensor,
                        max_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv_indices = self.page_table[rows, :max_len].to(torch.int64)
        valid = torch.arange(max_len, device=rows.device)[None, :] < lens[:, None]
        # Padding points at the request's own first slot: written, so finite (a 0 weight times garbage could be NaN).
        kv_indices = torch.where(valid, kv_indices, kv_indices[:, :1])
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        return kv_indices, mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata  # type: ignore[assignment]
        if not kv_stored:
            self.kv_cache.store_kv(k, v, meta.out_loc, layer_id)
        k_slots, v_slots = self._k[layer_id], self._v[layer_id]
        if meta.graph is not None:  # captured decode: everything comes from the fixed buffers
            lens = meta.graph.seq_lens
            meta.kv_indices, meta.kv_mask = self._decode_indices(meta.graph.table_idx, lens, int(lens.max()))
        k_scale, v_scale = self.kv_cache.k_scales[layer_id], self.kv_cache.v_scales[layer_id]
        if meta.is_decode:
            kb = self._gather(k_slots, meta.kv_indices, k_scale, q.dtype).transpose(1, 2)  # [bs, Hkv, S, D]
            vb = self._gather(v_slots, meta.kv_indices, v_scale, q.dtype).transpose(1, 2)
            return self._decode(q, kb, vb, meta.kv_mask)
        out = torch.empty_like(q)
        for seg in meta.segments or []:
            qi = q[seg.q_start : seg.q_end].transpose(0, 1)[None]  # [1, Hq, ext, D]
            ki = self._gather(k_slots, seg.kv_indices, k_scale, q.dtype).transpose(0, 1)[None]  # [1, Hkv, S, D]
            vi = self._gather(v_slots, seg.kv_indices, v_scale, q.dtype).transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=seg.mask, is_causal=seg.mask is None,
                                                scale=self.scale, enable_gqa=True)
            out[seg.q_start : seg.q_end] = oi[0].transpose(0, 1)
        return out

    def _gather(self, slots: torch.Tensor, indices: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Rows `indices` (any shape) of a [num_slots, heads * dim] view, as [*indices.shape, heads, dim] in
        `dtype`: the stored values times `scale` when the pool stores another dtype."""
        rows = slots.index_select(0, indices.reshape(-1))
        if self._bytes:
            rows = rows.view(self.kv_cache.dtype)
        if rows.dtype != dtype:
            rows = dequantize_kv(rows, scale, dtype)
        return rows.view(*indices.shape, self.num_kv_heads, self.head_dim)

    def _decode(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [bs, Hq, D] against each request's gathered keys / values kb, vb [bs, Hkv, S, D]."""
        bs, num_qo_heads, head_dim = q.shape
        group = num_qo_heads // self.num_kv_heads
        # GQA without repeating K/V: q head h uses kv head h // group, so a group's heads are rows of one query
        qg = q.view(bs, self.num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=mask, scale=self.scale)
        return o.reshape(bs, num_qo_heads, head_dim)  # SDPA output may be strided (CUDA)

    # ---- graph hooks: only the CPU emulation uses them (this backend cannot be captured in a real CUDA graph) ----
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        device = self.page_table.device
        self.capture = TorchCaptureData(table_idx=torch.zeros(max_bs, dtype=torch.int64, device=device),
                                        seq_lens=torch.ones(max_bs, dtype=torch.int64, device=device))

    def prepare_for_capture(self, batch: Batch) -> None:
        assert self.capture is not None, "init_capture_graph first"
        bs = batch.padded_size
        batch.attn_metadata = TorchAttnMetadata(  # out_loc: the graph runner's input buffer (set_batch runs first)
            out_loc=batch.out_loc, last_indices=torch.arange(bs, device=self.page_table.device), is_decode=True,
            graph=TorchCaptureData(self.capture.table_idx[:bs], self.capture.seq_lens[:bs]))
        # the capture batch is the dummy request at its zeroed page (slot 0 is not written yet at capture)
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        assert self.capture is not None
        reqs = batch.padded_reqs
        bs = len(reqs)
        self.capture.table_idx[:bs].copy_(torch.tensor([r.table_idx for r in reqs]))
        self.capture.seq_lens[:bs].copy_(torch.tensor([r.device_len for r in reqs]))
