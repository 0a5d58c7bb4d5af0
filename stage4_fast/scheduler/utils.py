from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core import SamplingParams

if TYPE_CHECKING:
    from .prefill import ChunkedReq


@dataclass(eq=False)
class PendingReq:
    """A request waiting for (the rest of) its prefill."""

    uid: int
    input_ids: torch.Tensor  # host, 1-D int32: the whole prompt
    sampling_params: SamplingParams
    chunked_req: ChunkedReq | None = None  # the chunk in progress, once admitted

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens
