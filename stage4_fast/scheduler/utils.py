from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Tuple

import numpy as np
import torch

from ..attention.utils import SeqLens
from ..core import Batch, SamplingParams
from ..utils import int_tensor
from ..utils.device import to_device, to_device_packed

if TYPE_CHECKING:
    from .prefill import ChunkedReq


@dataclass(eq=False)
class PendingReq:
    """A request waiting for (the rest of) its prefill."""

    uid: int
    input_ids: torch.Tensor  # host, 1-D int32: the whole prompt
    sampling_params: SamplingParams
    chunked_req: ChunkedReq | None = None  # the chunk in progress, once admitted
    input_len: int = field(init=False)  # read by every admission pass; len() of a tensor is slow

    def __post_init__(self) -> None:
        self.input_len = self.input_ids.shape[0]

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens


def run_indices(rows: Sequence[int] | np.ndarray, firsts: Sequence[int] | np.ndarray,
                counts: Sequence[int] | np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row, column) int64 host tensors of every element of runs: row rows[i], columns firsts[i] + [0, counts[i])."""
    counts = np.asarray(counts, dtype=np.int64)
    row_idx = np.repeat(np.asarray(rows, dtype=np.int64), counts)
    shift = np.asarray(firsts, dtype=np.int64) - (np.cumsum(counts) - counts)
    col_idx = np.arange(len(row_idx), dtype=np.int64) + np.repeat(shift, counts)
    return torch.from_numpy(row_idx), torch.from_numpy(col_idx)


def scatter_runs(target: torch.Tensor, runs: Sequence[Tuple[int, int, torch.Tensor]]) -> None:
    """``target[row, first : first + len(values)] = values`` for every run, as one index copy and one scatter."""
    if not runs:
        return
    rows, firsts, values = zip(*runs)
    row_idx, col_idx = run_indices(rows, firsts, [v.shape[0] for v in values])
    flat = torch.cat(values)
    if flat.device.type == "cpu" and target.device.type != "cpu":  # host values (prompt ids); slots are on the device
        flat = to_device(flat, target.device)
    target[tuple(to_device_packed([row_idx, col_idx], target.device))] = flat


def _input_index(lens: SeqLens) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of every input token in the token pool (host, int64)."""
    if lens.is_decode:  # (a decode batch extends every request by one)
        return lens.table_idx.to(torch.int64), lens.cached_lens.to(torch.int64)
    return run_indices(lens.table_idx.numpy(), lens.cached_lens.numpy(), lens.seqlens_q.numpy())


def _write_rows_and_cols(batch: Batch, lens: SeqLens) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where each request's sampled token goes in the token pool (host): position device_len before the forward; a
    chunk's junk token goes to its row's last column, overwritten before it is read (as upstream)."""
    n = batch.size
    rows = lens.table_idx[:n].to(torch.int64)
    if batch.is_decode:  # every request of a decode batch can decode (the running set keeps no other)
        return rows, lens.seqlens_k[:n].to(torch.int64)
    cols = int_tensor([r.device_len if r.can_decode else -1 for r in batch.reqs], torch.int64)
    return rows, cols


def make_index_tuples(batch: Batch, lens: SeqLens, device: torch.device
                        ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """(input tuple, write tuple): the token pool's (rows, columns) the batch reads and writes, in one device copy."""
    index = to_device_packed([*_input_index(lens), *_write_rows_and_cols(batch, lens)], device)
    return (index[0], index[1]), (index[2], index[3])
