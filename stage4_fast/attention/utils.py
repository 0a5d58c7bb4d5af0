"""Metadata pieces shared by the GPU backends: sequence-length prefix sums and the fixed CUDA-graph buffers."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from ..core import Batch, Req


@dataclass
class SeqLens:
    """Host-side lengths of one batch (built on the scheduler's side, before the forward)."""

    seqlens_q: torch.Tensor  # [bs] extend lengths, int32, host
    seqlens_k: torch.Tensor  # [bs] device lengths (prefix + extend), int32, host
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32, host
    cu_seqlens_k: torch.Tensor  # [bs + 1] int32, host
    table_idx: torch.Tensor  # [bs] page-table rows, int32, host
    cached_lens: torch.Tensor  # [bs] prefix lengths: each request's first query position, int32, host
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


_COLUMNS = [attrgetter(name) for name in ("table_idx", "cached_len", "device_len")]


def _prefix_sums(lengths: np.ndarray) -> torch.Tensor:
    out = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, dtype=np.int32, out=out[1:])
    return torch.from_numpy(out)


def make_seq_lens(reqs: Sequence[Req]) -> SeqLens:
    """The lengths of ``reqs`` now: one C-level pass per column, the rest in numpy (every request, every step)."""
    table_idx, cached, seqlens_k = (np.fromiter(map(get, reqs), np.int32, len(reqs)) for get in _COLUMNS)
    seqlens_q = seqlens_k - cached
    return SeqLens(seqlens_q=torch.from_numpy(seqlens_q), seqlens_k=torch.from_numpy(seqlens_k),
                   cu_seqlens_q=_prefix_sums(seqlens_q), cu_seqlens_k=_prefix_sums(seqlens_k),
                   table_idx=torch.from_numpy(table_idx), cached_lens=torch.from_numpy(cached),
                   max_seqlen_q=int(seqlens_q.max()) if len(reqs) else 0,
                   max_seqlen_k=int(seqlens_k.max()) if len(reqs) else 0)


def batch_seq_lens(batch: Batch) -> SeqLens:
    """The padded requests' lengths, built once before the forward (after it, every request has moved on)."""
    lens = batch.host_lens
    if lens is None or len(lens.table_idx) != len(batch.padded_reqs):
        lens = batch.host_lens = make_seq_lens(batch.padded_reqs)
    return lens


@dataclass
class BaseCaptureData:
    """Fixed metadata buffers of the captured decode graphs (largest batch); defaults (length 1, slot 0) are safe."""

    seq_lens: torch.Tensor  # [max_bs] int32
    cu_seqlens_k: torch.Tensor  # [max_bs + 1] int32
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32
    page_table: torch.Tensor  # [max_bs, max_seq_len] int32

    @classmethod
    def create(cls, max_bs: int, max_seq_len: int, device: torch.device):
        i32 = dict(dtype=torch.int32, device=device)
        return cls(seq_lens=torch.ones(max_bs, **i32), cu_seqlens_k=torch.arange(max_bs + 1, **i32),
                   cu_seqlens_q=torch.arange(max_bs + 1, **i32), page_table=torch.zeros(max_bs, max_seq_len, **i32))
