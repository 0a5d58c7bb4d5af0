"""Triton backend: the paged kernels of ``kernel/triton_attention.py`` and ``triton_prefill.py`` (a CPU interprets
them). Each reads the page table through its request's row: the metadata is three small vectors (graphs: buffers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..utils.device import to_device as upload
from ..utils.device import to_device_packed
from .base import BaseAttnBackend, BaseAttnMetadata
from .utils import batch_seq_lens

if TYPE_CHECKING:
    from ..core import Batch
    from ..models import ModelConfig

# a multiple of kernel/triton_attention.SCRATCH_SPLIT_ALIGN, so eager decodes share the graphs' compiled kernels
MAX_DECODE_SPLITS = 16


@dataclass
class TritonMetadata(BaseAttnMetadata):
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32, device
    seq_lens: torch.Tensor  # [bs] int32, device
    table_idx: torch.Tensor  # [bs] int32, device
    max_seqlen_q: int
    num_splits: int = 1  # decode split-K factor
    mid_o: torch.Tensor | None = None  # decode scratch (fixed buffers under a CUDA graph)
    mid_lse: torch.Tensor | None = None
    # prefill: the kernel's device work list (kernel/triton_prefill.py: prefill_block_map)
    block_map: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.cu_seqlens_q[1 : 1 + bs] - 1


@dataclass
class TritonPrefillCaptureData:
    """Fixed buffers a captured prefill graph reads its metadata from (a replay copies the batch's in)."""

    cu_seqlens_q: torch.Tensor  # [max_reqs + 1]
    seq_lens: torch.Tensor  # [max_reqs]
    table_idx: torch.Tensor  # [max_reqs]
    block_map: torch.Tensor  # [1 + 2 * capacity]: the kernel's grid covers every entry


@dataclass
class TritonCaptureData:
    table_idx: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] = arange: one query per request
    mid_o: torch.Tensor  # [max_bs, Hq, MAX_DECODE_SPLITS, D] fp32
    mid_lse: torch.Tensor  # [max_bs, Hq, MAX_DECODE_SPLITS] fp32


class TritonBackend(BaseAttnBackend):
    def __init__(self, config: ModelConfig):
        from ..kernel import triton_attention, triton_prefill

        self._kernels, self._prefill = triton_attention, triton_prefill
        ctx = get_global_ctx()
        self.kv_cache, self.page_table = ctx.kv_cache, ctx.page_table
        self.device = self.page_table.device
        self.scale = config.head_dim**-0.5
        k0 = self.kv_cache.k_cache(0)
        self.num_kv_heads, self.head_dim = k0.shape[-2], k0.shape[-1]
        self.num_qo_heads = config.num_qo_heads // get_tp_info().size
        layers = range(self.kv_cache.num_layers)
        self._k = [self.kv_cache.k_cache(i).view(-1, self.num_kv_heads, self.head_dim) for i in layers]
        self._v = [self.kv_cache.v_cache(i).view(-1, self.num_kv_heads, self.head_dim) for i in layers]
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        q_dtype, group = getattr(self.kv_cache, "compute_dtype", k0.dtype), self.num_qo_heads // self.num_kv_heads
        # an fp8 pool on an sm_89+ GPU decodes with the CUDA kernel, which wants fewer splits
        self._cuda_fp8 = triton_attention.cuda_fp8_decode_applies(q_dtype, k0.dtype, self.head_dim, group, self.device)
        self.capture: TritonCaptureData | None = None
        self.prefill_capture: TritonPrefillCaptureData | None = None
        self._prefill_max_reqs = 0  # init_prefill_capture
        self._prefill_block_m = self._prefill.prefill_block_m(q_dtype, group)

    def _num_splits(self, bs: int) -> int:
        return self._kernels.decode_num_splits(bs, self.num_kv_heads, MAX_DECODE_SPLITS, self.num_sms, self._cuda_fp8)

    def prepare_metadata(self, batch: Batch) -> None:
        lens = batch_seq_lens(batch)
        parts = [lens.cu_seqlens_q, lens.seqlens_k, lens.table_idx]
        if not lens.is_decode:
            parts.append(torch.from_numpy(self._prefill.prefill_block_map(
                lens.seqlens_q.numpy(), lens.seqlens_k.numpy(), self._prefill_block_m)))
        # the int32 vectors in one host -> device copy (a pinned buffer and a launch each otherwise)
        cu_seqlens_q, seq_lens, table_idx, *block_map = to_device_packed(parts, self.device)
        num_splits = self._num_splits(len(batch.padded_reqs)) if lens.is_decode else 1
        batch.attn_metadata = TritonMetadata(cu_seqlens_q, seq_lens, table_idx, lens.max_seqlen_q, num_splits,
                                             block_map=block_map[0] if block_map else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        meta: TritonMetadata = batch.attn_metadata  # type: ignore[assignment]
        if not kv_stored:
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        k_slots, v_slots = self._k[layer_id], self._v[layer_id]
        # an fp8 pool's scales (1.0 otherwise): plain floats, so a captured graph keeps them as kernel arguments
        scales = dict(k_scale=self.kv_cache.k_scales[layer_id], v_scale=self.kv_cache.v_scales[layer_id])
        if meta.is_decode:
            return self._kernels.decode_attention(q, k_slots, v_slots, self.page_table, meta.table_idx, meta.seq_lens,
                                                  self.scale, meta.num_splits, mid_o=meta.mid_o, mid_lse=meta.mid_lse,
                                                  **scales)
        block_map = (self._prefill_block_m, meta.block_map) if meta.block_map is not None else None
        return self._prefill.prefill_attention(q, k_slots, v_slots, self.page_table, meta.table_idx, meta.cu_seqlens_q,
                                               meta.seq_lens, meta.max_seqlen_q, self.scale, block_map=block_map,
                                               **scales)

    # ---- prefill CUDA graph hooks (engine/prefill_graph.py) ----
    def supports_prefill_graph(self) -> bool:
        return True

    def init_prefill_capture(self, num_tokens: int, max_reqs: int) -> None:
        self._prefill_max_reqs = max_reqs
        capacity = self._prefill_capacity(num_tokens)
        buffers = to_device_packed([torch.zeros(max_reqs + 1, dtype=torch.int32),
                                    torch.ones(max_reqs, dtype=torch.int32), torch.zeros(max_reqs, dtype=torch.int32),
                                    torch.zeros(1 + 2 * capacity, dtype=torch.int32)], self.device)
        self.prefill_capture = TritonPrefillCaptureData(*buffers)

    def _prefill_capacity(self, num_tokens: int) -> int:
        return self._prefill.prefill_block_map_capacity(num_tokens, min(self._prefill_max_reqs, num_tokens),
                                                        self._prefill_block_m)

    def prepare_for_prefill_capture(self, batch: Batch) -> None:
        """After prepare_metadata(batch): its metadata moves into the fixed buffers every token count's graph reads."""
        cap = self.prefill_capture
        assert cap is not None, "init_prefill_capture first"
        self.prepare_for_prefill_replay(batch)
        capacity = self._prefill_capacity(batch.input_ids.shape[0])
        batch.attn_metadata = TritonMetadata(cu_seqlens_q=cap.cu_seqlens_q, seq_lens=cap.seq_lens,
                                             table_idx=cap.table_idx, max_seqlen_q=batch.attn_metadata.max_seqlen_q,
                                             block_map=cap.block_map[: 1 + 2 * capacity])

    def prepare_for_prefill_replay(self, batch: Batch) -> None:
        cap = self.prefill_capture
        meta: TritonMetadata = batch.attn_metadata  # type: ignore[assignment]
        for buffer, part in ((cap.cu_seqlens_q, meta.cu_seqlens_q), (cap.seq_lens, meta.seq_lens),
                             (cap.table_idx, meta.table_idx), (cap.block_map, meta.block_map)):
            buffer[: part.shape[0]].copy_(part)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        i32 = dict(dtype=torch.int32, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.capture = TritonCaptureData(
            table_idx=torch.zeros(max_bs, **i32), seq_lens=torch.ones(max_bs, **i32),
            cu_seqlens_q=torch.arange(max_bs + 1, **i32),
            mid_o=torch.empty(max_bs, self.num_qo_heads, MAX_DECODE_SPLITS, self.head_dim, **f32),
            mid_lse=torch.empty(max_bs, self.num_qo_heads, MAX_DECODE_SPLITS, **f32))

    def prepare_for_capture(self, batch: Batch) -> None:
        cap = self.capture
        assert cap is not None, "init_capture_graph first"
        bs = batch.padded_size
        # the capture batch is the dummy request at its zeroed page (slot 0 is not written yet at capture)
        cap.table_idx[:bs].copy_(upload(batch_seq_lens(batch).table_idx, self.device))
        batch.attn_metadata = TritonMetadata(
            cu_seqlens_q=cap.cu_seqlens_q[: bs + 1], seq_lens=cap.seq_lens[:bs], table_idx=cap.table_idx[:bs],
            max_seqlen_q=1, num_splits=self._num_splits(bs), mid_o=cap.mid_o[:bs], mid_lse=cap.mid_lse[:bs],
        )

    def prepare_for_replay(self, batch: Batch) -> None:
        cap = self.capture
        meta: TritonMetadata = batch.attn_metadata  # type: ignore[assignment]
        bs = batch.padded_size
        cap.table_idx[:bs].copy_(meta.table_idx)
        cap.seq_lens[:bs].copy_(meta.seq_lens)

