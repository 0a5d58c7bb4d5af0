"""FlashInfer backend (plan/run wrappers) over page size 1 views, as upstream. ``plan`` does host work, so it runs
at the first layer's forward, after the previous plan's staging copy; graphs get one decode wrapper per batch size."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, List

import torch

from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..utils.device import NullEvent, is_cuda
from ..utils.device import to_device as upload
from .base import BaseAttnBackend, BaseAttnMetadata
from .utils import BaseCaptureData, SeqLens, batch_seq_lens

if TYPE_CHECKING:
    from ..core import Batch
    from ..models import ModelConfig

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FIMetadata(BaseAttnMetadata):
    cu_seqlens_q_cpu: torch.Tensor
    cu_seqlens_k_cpu: torch.Tensor
    cu_seqlens_q_gpu: torch.Tensor
    indices: torch.Tensor  # concatenated token slots of every request, device int32
    last_page_len_cpu: torch.Tensor  # all ones: page size 1
    seq_lens_cpu: torch.Tensor
    wrapper: Any  # the decode wrapper for decode batches, the prefill wrapper otherwise
    is_decode: bool
    initialized: bool = False

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.cu_seqlens_q_gpu[1 : 1 + bs] - 1


@dataclass
class FICaptureData(BaseCaptureData):
    @property
    def indices(self) -> torch.Tensor:
        return self.page_table.view(-1)  # the flattened page-table buffer holds the indices

    @property
    def one_tensor(self) -> torch.Tensor:
        return self.seq_lens  # created as ones: the last page length of page size 1


def load_flashinfer() -> ModuleType:
    import flashinfer

    return flashinfer


class FlashInferBackend(BaseAttnBackend):
    def __init__(self, config: ModelConfig):
        self._flashinfer = flashinfer = load_flashinfer()
        ctx = get_global_ctx()
        self.kv_cache = ctx.kv_cache
        self.page_table = ctx.page_table
        self.device = self.page_table.device
        tp = get_tp_info().size
        k0 = self.kv_cache.k_cache(0)
        self.qo_head_local = config.num_qo_heads // tp
        self.kv_head_local = k0.shape[-2]
        self.head_dim = config.head_dim
        self.use_tensor_cores = self.qo_head_local // self.kv_head_local >= 4  # as upstream
        self.float_workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.float_workspace, kv_layout="NHD",
                                                                              backend="fa2")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.float_workspace, use_tensor_cores=self.use_tensor_cores, kv_layout="NHD", backend="fa2")
        layers = range(self.kv_cache.num_layers)
        self._k = [self.kv_cache.k_cache(i).view(-1, 1, self.kv_head_local, self.head_dim) for i in layers]
        self._v = [self.kv_cache.v_cache(i).view(-1, 1, self.kv_head_local, self.head_dim) for i in layers]
        self.last_event: torch.cuda.Event | NullEvent = NullEvent()
        self.capture: FICaptureData | None = None
        self.graph_wrappers: Dict[int, Any] = {}

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        lens = batch_seq_lens(batch)
        batch.attn_metadata = FIMetadata(
            lens.cu_seqlens_q, lens.cu_seqlens_k, upload(lens.cu_seqlens_q, self.device), self._kv_indices(lens),
            torch.ones(len(reqs), dtype=torch.int32), lens.seqlens_k,
            self.decode_wrapper if lens.is_decode else self.prefill_wrapper, lens.is_decode,
        )

    def _kv_indices(self, lens: SeqLens) -> torch.Tensor:
        """Every request's token slots, concatenated, in a few device ops and no host sync."""
        total = int(lens.cu_seqlens_k[-1])
        seq_lens = upload(lens.seqlens_k, self.device)
        starts = upload(lens.cu_seqlens_k[:-1], self.device)
        rows = torch.repeat_interleave(upload(lens.table_idx, self.device), seq_lens, output_size=total)
        cols = torch.arange(total, device=self.device) - torch.repeat_interleave(starts, seq_lens, output_size=total)
        return self.page_table[rows, cols]

    def _plan(self, meta: FIMetadata) -> None:
        self.last_event.synchronize()  # the previous plan's pinned staging copy has been consumed
        # kv_data_type: the pool's, the model's or fp8 (FlashInfer converts as it loads)
        common = dict(num_qo_heads=self.qo_head_local, num_kv_heads=self.kv_head_local, page_size=1,
                      pos_encoding_mode="NONE", seq_lens=meta.seq_lens_cpu, q_data_type=self.kv_cache.compute_dtype,
                      kv_data_type=self.kv_cache.dtype, non_blocking=True)
        if meta.is_decode:
            meta.wrapper.plan(indptr=meta.cu_seqlens_k_cpu, indices=meta.indices, last_page_len=meta.last_page_len_cpu,
                              head_dim=self.head_dim, **common)
        else:
            meta.wrapper.plan(
                qo_indptr=meta.cu_seqlens_q_cpu, paged_kv_indptr=meta.cu_seqlens_k_cpu, paged_kv_indices=meta.indices,
                paged_kv_last_page_len=meta.last_page_len_cpu, head_dim_qk=self.head_dim, causal=True, **common)
        if is_cuda(self.device):
            self.last_event = torch.cuda.Event()
            self.last_event.record()
        meta.initialized = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        meta: FIMetadata = batch.attn_metadata  # type: ignore[assignment]
        if not kv_stored:
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        if not meta.initialized:
            self._plan(meta)
        # fp8 scales; v_scale costs a kernel, so 1.0 is not passed
        k_scale, v_scale = (s[layer_id] if s[layer_id] != 1.0 else None
                            for s in (self.kv_cache.k_scales, self.kv_cache.v_scales))
        return meta.wrapper.run(q=q, paged_kv_cache=(self._k[layer_id], self._v[layer_id]), k_scale=k_scale,
                                v_scale=v_scale)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.capture = FICaptureData.create(max(bs_list), max_seq_len, self.device)

    def _graph_wrapper(self, bs: int) -> Any:
        if bs not in self.graph_wrappers:
            cap = self.capture
            assert cap is not None, "init_capture_graph first"
            self.graph_wrappers[bs] = self._flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                self.float_workspace, indptr_buffer=cap.cu_seqlens_k[: bs + 1], indices_buffer=cap.indices,
                last_page_len_buffer=cap.one_tensor[:bs], kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        return self.graph_wrappers[bs]

    def prepare_for_capture(self, batch: Batch) -> None:
        cap = self.capture
        assert cap is not None, "init_capture_graph first"
        bs = batch.padded_size
        # the capture batch is the dummy request at its zeroed page (slot 0 is not written yet at capture)
        cap.indices[:bs].copy_(self._kv_indices(batch_seq_lens(batch)))
        one_each = torch.arange(bs + 1, dtype=torch.int32)
        meta = FIMetadata(one_each, one_each, cap.cu_seqlens_q[: bs + 1], cap.indices[:bs],
                              torch.ones(bs, dtype=torch.int32), torch.ones(bs, dtype=torch.int32),
                              self._graph_wrapper(bs), True)
        self._plan(meta)
        batch.attn_metadata = meta

    def prepare_for_replay(self, batch: Batch) -> None:
        meta: FIMetadata = batch.attn_metadata  # type: ignore[assignment]
        meta.wrapper = self._graph_wrapper(batch.padded_size)
        self._plan(meta)  # copies indptr / indices / last-page lengths into the captured buffers
