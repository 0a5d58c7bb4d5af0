from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

if TYPE_CHECKING:
    from ..core import Batch


@dataclass
class QkPrologue:
    """What a layer's q/k norm + RoPE kernel takes (kernel/triton_fused.qk_norm_rope with its KV store), for a
    backend whose decode kernel does that work itself (``BaseAttnBackend.forward_qkv``)."""

    q_norm: torch.Tensor | None  # [D] per-head RMSNorm weights (Qwen3), or None for none (with k_norm)
    k_norm: torch.Tensor | None
    eps: float
    cos_sin_cache: torch.Tensor  # [max_position, D] fp32: cos | sin
    positions: torch.Tensor  # [T] int32
    out_loc: torch.Tensor  # [T] int32: each token's slot in the pool
    row_scale: tuple[torch.Tensor, float] | None = None  # (hidden [T, N], eps): the deferred input norm


@dataclass
class BaseAttnMetadata(ABC):
    @abstractmethod
    def get_last_indices(self, bs: int) -> torch.Tensor:
        """Row of each request's last query token in the flattened token dimension (the LM head keeps those)."""


class BaseAttnBackend(ABC):
    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, qo_heads, D], k/v [T, kv_heads, D] -> [T, qo_heads, D]. Stores this step's K/V in the pool first
        (unless ``kv_stored``: the fused q/k norm + RoPE kernel wrote them already), then attends against the pool."""

    def forward_qkv(self, qkv: torch.Tensor, prologue: QkPrologue, layer_id: int, batch: Batch) -> torch.Tensor | None:
        """The same from the layer's raw qkv projection [T, (Hq + Kv + Kv) * D], where this backend's kernel does
        the q/k norm + RoPE and the KV store itself (``prologue``): [T, Hq, D], or None where it does not (the
        layer then runs the q/k kernel and ``forward``)."""
        return None

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build batch.attn_metadata from batch.padded_reqs, once per forward (before it)."""

    # CUDA-graph hooks: used from stage4 on; a backend without graph support leaves them unimplemented.
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        raise NotImplementedError

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError


class HybridBackend(BaseAttnBackend):
    """One backend for prefill batches, another for decode (``--attn fa,fi``). Graphs capture decode only, so the
    graph hooks go to the decode backend."""

    def __init__(self, prefill_backend: BaseAttnBackend, decode_backend: BaseAttnBackend):
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

    def _pick(self, batch: Batch) -> BaseAttnBackend:
        return self.prefill_backend if batch.is_prefill else self.decode_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        return self._pick(batch).forward(q, k, v, layer_id, batch, kv_stored)

    def forward_qkv(self, qkv: torch.Tensor, prologue: QkPrologue, layer_id: int, batch: Batch) -> torch.Tensor | None:
        return self._pick(batch).forward_qkv(qkv, prologue, layer_id, batch)

    def prepare_metadata(self, batch: Batch) -> None:
        self._pick(batch).prepare_metadata(batch)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.decode_backend.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_replay(batch)
