from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

if TYPE_CHECKING:
    from ..core import Batch


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

    # Prefill graphs at fixed token counts (engine/prefill_graph.py), for backends whose fixed buffers allow it
    def supports_prefill_graph(self) -> bool:
        return False

    def init_prefill_capture(self, num_tokens: int, max_reqs: int) -> None:
        raise NotImplementedError

    def prepare_for_prefill_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_prefill_replay(self, batch: Batch) -> None:
        raise NotImplementedError


class HybridBackend(BaseAttnBackend):
    """One backend for prefill batches, another for decode (``--attn fa,fi``), graph hooks included."""

    def __init__(self, prefill_backend: BaseAttnBackend, decode_backend: BaseAttnBackend):
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

    def _pick(self, batch: Batch) -> BaseAttnBackend:
        return self.prefill_backend if batch.is_prefill else self.decode_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        return self._pick(batch).forward(q, k, v, layer_id, batch, kv_stored)

    def prepare_metadata(self, batch: Batch) -> None:
        self._pick(batch).prepare_metadata(batch)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.decode_backend.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_replay(batch)

    def supports_prefill_graph(self) -> bool:
        return self.prefill_backend.supports_prefill_graph()

    def init_prefill_capture(self, num_tokens: int, max_reqs: int) -> None:
        self.prefill_backend.init_prefill_capture(num_tokens, max_reqs)

    def prepare_for_prefill_capture(self, batch: Batch) -> None:
        self.prefill_backend.prepare_for_prefill_capture(batch)

    def prepare_for_prefill_replay(self, batch: Batch) -> None:
        self.prefill_backend.prepare_for_prefill_replay(batch)
