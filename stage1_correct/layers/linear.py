"""Linear layers, already shaped for tensor parallelism (weight layout [local_out, local_in]).

With tp = 1 (stage1) every local size equals the full size and the all-reduce after the row-parallel kinds is not
needed; the shapes are the TP shapes so that stage4 only adds the communication.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from ..distributed import get_tp_info
from ..utils import div_even
from .base import BaseOP


class _LinearTPImpl(BaseOP):
    def __init__(self, local_isize: int, local_osize: int, has_bias: bool):
        self.weight = torch.empty(local_osize, local_isize)
        self.bias = torch.empty(local_osize) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearReplicated(_LinearTPImpl):
    """Full weight on every rank (e.g. the MoE router)."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool):
        super().__init__(input_size, output_size, has_bias)


class LinearColParallelMerged(_LinearTPImpl):
    """Several column-parallel outputs fused into one GEMM (gate+up); local rows are [gate_shard; up_shard]."""

    def __init__(self, input_size: int, output_sizes: List[int], has_bias: bool):
        tp = get_tp_info().size
        super().__init__(input_size, sum(div_even(size, tp) for size in output_sizes), has_bias)


class LinearQKVMerged(_LinearTPImpl):
    """Fused q/k/v projection, rows [q; k; v]. KV heads are replicated when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_qo_heads: int, num_kv_heads: int, has_bias: bool):
        tp = get_tp_info().size
        qo_local = div_even(num_qo_heads, tp)
        kv_local = div_even(num_kv_heads, tp, allow_replicate=True)
        super().__init__(hidden_size, (qo_local + 2 * kv_local) * head_dim, has_bias)


class LinearRowParallel(_LinearTPImpl):
    """Input split across ranks; the partial sums are all-reduced (only needed when tp > 1, from stage4)."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool):
        tp = get_tp_info().size
        super().__init__(div_even(input_size, tp), output_size, has_bias)


class LinearOProj(LinearRowParallel):
    """The attention output projection: row-parallel, like down_proj."""
