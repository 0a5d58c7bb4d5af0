"""Metadata pieces shared by the GPU backends: sequence-length prefix sums and the fixed CUDA-graph buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

from ..utils import int_tensor
from ..utils.device import to_device

if TYPE_CHECKING:
    from ..core import Req


@dataclass
class SeqLens:
    """Host-side lengths of one batch (built on the scheduler's side, before the forward)."""

    seqlens_q: torch.Tensor  # [bs] extend lengths, int32, host
    seqlens_k: torch.Tensor  # [bs] device lengths (prefix + extend), int32, host
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32, host
    cu_seqlens_k: torch.Tensor  # [bs + 1] int32, host
    table_idx: torch.Tensor  # [bs] page-table rows, int32, host
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


def make_seq_lens(reqs: List[Req]) -> SeqLens:
    seqlens_q = int_tensor([r.extend_len for r in reqs])
    seqlens_k = int_tensor([r.device_len for r in reqs])
    zero = torch.zeros(1, dtype=torch.int32)
    return SeqLens(
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        cu_seqlens_q=torch.cat([zero, seqlens_q.cumsum(0, dtype=torch.int32)]),
        cu_seqlens_k=torch.cat([zero, seqlens_k.cumsum(0, dtype=torch.int32)]),
        table_idx=int_tensor([r.table_idx for r in reqs]),
        max_seqlen_q=int(seqlens_q.max()) if len(reqs) else 0,
        max_seqlen_k=int(seqlens_k.max()) if len(reqs) else 0,
    )


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned, non-blocking host -> device copy (identity on CPU)."""
    return to_device(t, device)


@dataclass
class BaseCaptureData:
    """Fixed buffers, sized for the largest captured batch, that a captured decode graph reads its metadata from.
    Values are harmless defaults (length 1, slot 0) so a capture run touches valid memory."""

    seq_lens: torch.Tensor  # [max_bs] int32
    positions: torch.Tensor  # [max_bs] int32
    cu_seqlens_k: torch.Tensor  # [max_bs + 1] int32
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32
    page_table: torch.Tensor  # [max_bs, max_seq_len] int32

    @classmethod
    def create(cls, max_bs: int, max_seq_len: int, device: torch.device, **kwargs: torch.Tensor):
        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return cls(
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            positions=i32(max_bs),
            cu_seqlens_k=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            page_table=i32(max_bs, max_seq_len),
            **kwargs,
        )
