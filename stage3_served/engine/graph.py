"""Stand-in for upstream's CUDA-graph runner: the same interface, no graphs yet (they arrive in stage4)."""

from __future__ import annotations

import torch

from ..core import Batch, Req


class GraphRunner:
    def __init__(self, dummy_req: Req) -> None:
        self.dummy_req = dummy_req  # pads decode batches up to a captured size, once graphs exist
        self.max_graph_bs = 0
        self.graph_bs_list: list[int] = []

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return False

    def pad_batch(self, batch: Batch) -> None:
        """No captured sizes, so no padding: padded_reqs is the batch itself."""
        batch.padded_reqs = list(batch.reqs)

    def replay(self, batch: Batch) -> torch.Tensor:
        raise RuntimeError("no CUDA graphs in this stage")

    def destroy_cuda_graphs(self) -> None:
        pass
