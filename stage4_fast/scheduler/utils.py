from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Tuple

import numpy as np
import torch

from ..core import SamplingParams
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
    # read several times per request by every admission pass; len() of a tensor is slow Python
    input_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.input_len = self.input_ids.shape[0]

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens


def run_indices(rows: Sequence[int] | np.ndarray, firsts: Sequence[int] | np.ndarray,
                counts: Sequence[int] | np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element of some runs, run i being columns [firsts[i], firsts[i] + counts[i]) of row
    rows[i]: int64 host tensors, built in numpy as one arange shifted per run (not one arange per run)."""
    counts = np.asarray(counts, dtype=np.int64)
    row_idx = np.repeat(np.asarray(rows, dtype=np.int64), counts)
    shift = np.asarray(firsts, dtype=np.int64) - (np.cumsum(counts) - counts)
    col_idx = np.arange(len(row_idx), dtype=np.int64) + np.repeat(shift, counts)
    return torch.from_numpy(row_idx), torch.from_numpy(col_idx)


def scatter_runs(target: torch.Tensor, runs: Sequence[Tuple[int, int, torch.Tensor]]) -> None:
    """``target[row, first : first + len(values)] = values`` for every (row, first, values) run, as one copy of the
    indices and one scatter: a slice assignment per run costs a GPU a launch each (and a host copy each for host
    values), and a prefill batch writes a run for each of its requests."""
    if not runs:
        return
    rows, firsts, values = zip(*runs)
    row_idx, col_idx = run_indices(rows, firsts, [v.shape[0] for v in values])
    flat = torch.cat(values)
    if flat.device.type == "cpu" and target.device.type != "cpu":  # host values (prompt ids); slots are on the device
        flat = to_device(flat, target.device)
    target[tuple(to_device_packed([row_idx, col_idx], target.device))] = flat
