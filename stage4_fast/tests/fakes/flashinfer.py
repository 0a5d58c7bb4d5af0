"""Fake ``flashinfer`` (0.5.3 API): paged prefill / decode wrappers with plan/run, and the CUDA-graph decode wrapper."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .attention_math import causal_attention

calls: List[Tuple[str, Dict[str, Any]]] = []  # (what, arguments) of every plan: tests inspect them


def _dtypes(q_data_type: Any, kv_data_type: Any, data_type: Any = None) -> Tuple[torch.dtype, torch.dtype]:
    """(q, kv) dtypes of a plan, resolved as the library does (``data_type`` is the deprecated both-at-once,
    used only where the other one is None; names are canonicalised to torch dtypes)."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q = getattr(torch, q_data_type) if isinstance(q_data_type, str) else q_data_type
    kv = q if kv_data_type is None else kv_data_type
    return q, getattr(torch, kv) if isinstance(kv, str) else kv


def _int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")


class _PagedWrapper:
    causal = False

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        if kv_layout != "NHD":
            raise NotImplementedError("the fake implements NHD only")
        self._plan: Dict[str, Any] | None = None

    def _set_plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                  last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                  sm_scale: float | None, dtypes: Tuple[Any, Any]) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("indptr", indptr), ("indices", indices),
                        ("last_page_len", last_page_len)):
            _int32(name, t)
        assert len(indptr) == len(last_page_len) + 1 == len(qo_indptr)
        self._plan = dict(qo_indptr=qo_indptr.cpu().clone(), indptr=indptr.cpu().clone(), indices=indices.clone(),
                          last_page_len=last_page_len.cpu().clone(), num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                          sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale, dtypes=dtypes)

    def _plan_now(self) -> Dict[str, Any]:
        assert self._plan is not None, "run before plan"
        return self._plan

    def run(self, q: torch.Tensor, paged_kv_cache: Tuple[torch.Tensor, torch.Tensor], *args: Any,
            q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, window_left: int | None = None,
            sinks: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        plan = self._plan_now()
        k_cache, v_cache = paged_kv_cache
        q_dtype, kv_dtype = plan["dtypes"]
        if q.dtype != q_dtype:  # the library's _check_cached_qkv_data_type
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {q_dtype} specified in plan")
        if k_cache.dtype != kv_dtype:
            raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {kv_dtype}")
        # the library folds k_scale into the softmax scale and multiplies the output by v_scale
        sm_scale = plan["sm_scale"] * (1.0 if k_scale is None else k_scale)
        page_size = plan["page_size"]
        assert k_cache.dim() == 4 and k_cache.shape[1] == page_size, "NHD cache is [pages, page_size, H, D]"
        assert k_cache.shape[2] == plan["num_kv_heads"] and k_cache.shape[3] == plan["head_dim"]
        qo_indptr, indptr, indices, last = plan["qo_indptr"], plan["indptr"], plan["indices"], plan["last_page_len"]
        assert q.shape[0] == int(qo_indptr[-1]) and q.shape[1] == plan["num_qo_heads"]
        result = torch.empty_like(q) if out is None else out
        for i in range(len(last)):
            pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
            kv_len = (len(pages) - 1) * page_size + int(last[i])
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len]
            a, b = int(qo_indptr[i]), int(qo_indptr[i + 1])
            result[a:b] = causal_attention(q[a:b], k, v, sm_scale, self.causal)
        if v_scale is not None:
            result *= v_scale
        return result


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
                 backend: str = "auto", jit_args: List[Any] | None = None,
                 jit_kwargs: Dict[str, Any] | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        assert not use_cuda_graph, "the fake prefill wrapper has no graph mode"

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type: Any = "float16", kv_data_type: Any = None,
             non_blocking: bool = True, seq_lens: torch.Tensor | None = None, **kwargs: Any) -> None:
        assert pos_encoding_mode == "NONE"
        calls.append(("prefill", dict(causal=causal, page_size=page_size, q_data_type=q_data_type,
                                      kv_data_type=kv_data_type)))
        self.causal = causal
        self._set_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, head_dim_qk, page_size, sm_scale, _dtypes(q_data_type, kv_data_type))


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
                 jit_args: List[Any] | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert paged_kv_last_page_len_buffer is not None and paged_kv_indptr_buffer is not None
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._last_page_len_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, data_type: Any = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True,
             block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        assert pos_encoding_mode == "NONE"
        dtypes = _dtypes(q_data_type, kv_data_type, data_type)
        calls.append(("decode", dict(page_size=page_size, cuda_graph=self._use_cuda_graph, batch=len(last_page_len),
                                     q_data_type=dtypes[0], kv_data_type=dtypes[1])))
        if self._use_cuda_graph:
            # the real library copies into the fixed buffers; replays read them and nothing else
            assert self._indptr_buf is not None and self._indices_buf is not None
            assert self._last_page_len_buf is not None
            if len(last_page_len) != len(self._last_page_len_buf):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self._indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._indptr_buf.copy_(indptr)
            self._last_page_len_buf.copy_(last_page_len)
            self._indices_buf[: len(indices)].copy_(indices)
            self._graph_geometry = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        page_size=page_size, sm_scale=sm_scale, dtypes=dtypes)
            return
        bs = len(last_page_len)
        self._set_plan(torch.arange(bs + 1, dtype=torch.int32), indptr, indices, last_page_len, num_qo_heads,
                       num_kv_heads, head_dim, page_size, sm_scale, dtypes)

    def _plan_now(self) -> Dict[str, Any]:
        if not self._use_cuda_graph:
            return super()._plan_now()
        assert self._indptr_buf is not None and self._indices_buf is not None and self._last_page_len_buf is not None
        g = self._graph_geometry
        bs = len(self._last_page_len_buf)
        return dict(qo_indptr=torch.arange(bs + 1, dtype=torch.int32), indptr=self._indptr_buf.cpu(),
                    indices=self._indices_buf, last_page_len=self._last_page_len_buf.cpu(),
                    num_qo_heads=g["num_qo_heads"], num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"],
                    page_size=g["page_size"],
                    sm_scale=g["head_dim"] ** -0.5 if g["sm_scale"] is None else g["sm_scale"], dtypes=g["dtypes"])


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor, indices_buffer: torch.Tensor,
                 last_page_len_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)
