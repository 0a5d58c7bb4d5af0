"""FlashAttention backend: ``flash_attn.cute.flash_attn_varlen_func`` (flash-attn-4; upstream uses FA3 through
sgl-kernel) with ragged queries, ``seqused_k`` and a page table of page ids over [num_pages, page_size, kv_heads, D]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List

import torch

from ..core import get_global_ctx
from ..utils.device import to_device as upload
from .base import BaseAttnBackend, BaseAttnMetadata
from .utils import BaseCaptureData, batch_seq_lens

if TYPE_CHECKING:
    from ..core import Batch
    from ..models import ModelConfig


@dataclass
class FAMetadata(BaseAttnMetadata):
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor  # [bs] KV length of each sequence
    max_seqlen_k: int
    max_seqlen_q: int
    page_table: torch.Tensor  # [bs, pages] page ids, int32

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.cu_seqlens_q[1 : 1 + bs] - 1


def load_flash_attn_varlen_func() -> Callable[..., object]:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


class FlashAttentionBackend(BaseAttnBackend):
    def __init__(self, config: ModelConfig):
        self._varlen = load_flash_attn_varlen_func()
        ctx = get_global_ctx()
        self.kv_cache = ctx.kv_cache
        self.page_table = ctx.page_table
        self.page_size = ctx.page_size
        self.device = self.page_table.device
        self.scale = config.head_dim**-0.5
        self.capture: BaseCaptureData | None = None

    def _page_rows(self, table_idx: torch.Tensor, width: int) -> torch.Tensor:
        """Each request's page-table row cut to ``width`` tokens, one entry per page, as page ids."""
        rows = self.page_table[table_idx.long(), : width : self.page_size]
        return rows // self.page_size if self.page_size > 1 else rows

    def prepare_metadata(self, batch: Batch) -> None:
        lens = batch_seq_lens(batch)
        cu_seqlens_k = upload(lens.cu_seqlens_k, self.device)
        if lens.is_decode:
            cu_seqlens_q = torch.arange(len(batch.padded_reqs) + 1, dtype=torch.int32, device=self.device)
        elif all(r.cached_len == 0 for r in batch.padded_reqs):
            cu_seqlens_q = cu_seqlens_k
        else:
            cu_seqlens_q = upload(lens.cu_seqlens_q, self.device)
        page_table = self._page_rows(upload(lens.table_idx, self.device), lens.max_seqlen_k).contiguous()
        batch.attn_metadata = FAMetadata(cu_seqlens_k, cu_seqlens_q, upload(lens.seqlens_k, self.device),
                                         lens.max_seqlen_k, lens.max_seqlen_q, page_table)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        meta: FAMetadata = batch.attn_metadata  # type: ignore[assignment]
        if not kv_stored:
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        result = self._varlen(q, self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id),
                              cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                              max_seqlen_k=meta.max_seqlen_k, seqused_k=meta.cache_seqlens, page_table=meta.page_table,
                              softmax_scale=self.scale, causal=True)
        return result[0] if isinstance(result, tuple) else result  # (out, lse)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.capture = BaseCaptureData.create(max(bs_list), max_seq_len // self.page_size, self.device)

    def prepare_for_capture(self, batch: Batch) -> None:
        cap = self.capture
        assert cap is not None, "init_capture_graph first"
        bs = batch.padded_size
        width = cap.page_table.shape[1]
        # the capture batch is the dummy request at its zeroed page (page 0 is not written yet at capture)
        lens = batch_seq_lens(batch)
        cap.page_table[:bs, :1].copy_(self._page_rows(upload(lens.table_idx, self.device), 1))
        batch.attn_metadata = FAMetadata(  # max_seqlen_k: a bound that covers every replay
            cap.cu_seqlens_k[: bs + 1], cap.cu_seqlens_q[: bs + 1], cap.seq_lens[:bs], width * self.page_size, 1,
            cap.page_table[:bs, :])

    def prepare_for_replay(self, batch: Batch) -> None:
        cap = self.capture
        meta: FAMetadata = batch.attn_metadata  # type: ignore[assignment]
        bs = batch.padded_size
        cap.cu_seqlens_k[: bs + 1].copy_(meta.cu_seqlens_k)
        cap.seq_lens[:bs].copy_(meta.cache_seqlens)
        cap.page_table[:bs, : meta.page_table.shape[1]].copy_(meta.page_table)
