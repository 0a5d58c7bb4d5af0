"""Linear layers in their tensor-parallel splits (weight layout [local_out, local_in]).

Column-parallel kinds (merged gate/up, fused QKV) split the outputs and need no communication; the row-parallel
kinds (o_proj, down_proj) split the inputs, so each rank holds a partial sum that is all-reduced."""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn.functional as F

from ..distributed import DistributedCommunicator, get_tp_info
from ..kernel import gemv_kernel_for
from ..utils import div_even
from .activation import silu_and_mul
from .base import BaseOP
from .norm import RMSNormFused


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           silu_mul_input: bool = False) -> torch.Tensor:
    """F.linear, or the Triton GEMV for a one-token 16-bit GPU forward (cuBLAS is latency-bound there).
    ``silu_mul_input``: x is [gate | up], the input silu(gate) * up (down_proj), computed on the fly by the GEMV."""
    gemv = gemv_kernel_for(x)
    if gemv is not None and weight.stride(-1) == 1:
        return gemv.gemv(x, weight, bias, gated=silu_mul_input)
    return F.linear(silu_and_mul(x) if silu_mul_input else x, weight, bias)


class _LinearTPImpl(BaseOP):
    def __init__(self, local_isize: int, local_osize: int, has_bias: bool):
        self.weight = torch.empty(local_osize, local_isize)
        self.bias = torch.empty(local_osize) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def warm_up_gemms(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """This layer's cuBLAS calls for ``x``'s rows, without communication; ``residual``: a [rows, out] buffer."""
        F.linear(x, self.weight, self.bias)

    def forward_after_norm(self, norm: RMSNormFused, x: torch.Tensor,
                           residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``norm.forward(x, residual)`` then this layer: (output, residual stream); one GEMV kernel for a one-token
        16-bit GPU forward. Only for layers whose input is whole on every rank (a norm needs the row)."""
        gemv = gemv_kernel_for(x)
        fold = gemv is not None and self.weight.stride(-1) == 1
        if fold and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
            return gemv.normed_gemv(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        normed, residual = norm.forward(x, residual)
        return self.forward(normed), residual


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
    """Input split across ranks; the partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool):
        tp = get_tp_info()
        super().__init__(div_even(input_size, tp.size), output_size, has_bias)
        self._tp_size, self._tp_rank = tp.size, tp.rank
        self._comm = DistributedCommunicator()

    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """``silu_mul_input``: x is [gate | up] of a gated MLP, the layer's input silu(gate) * up (see ``linear``)."""
        if self._tp_size == 1:
            return linear(x, self.weight, self.bias, silu_mul_input)
        # the bias must be added once, after the sum
        y = self._comm.all_reduce(linear(x, self.weight, None, silu_mul_input))
        return y if self.bias is None else y + self.bias

    def warm_up_gemms(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        super().warm_up_gemms(x, residual)
        if self.bias is None and residual is not None:  # forward_add's GEMM, which reads the residual (beta = 1)
            residual.addmm_(x, self.weight.t())

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this layer's output over ``residual``, added in the GEMM (beta = 1; under TP by rank 0 only)."""
        if self.bias is not None:
            return residual.add_(self.forward(x))
        if self._tp_size == 1:
            return residual.addmm_(x, self.weight.t())
        if self._tp_rank == 0:
            residual.addmm_(x, self.weight.t())
        else:
            torch.mm(x, self.weight.t(), out=residual)
        return self._comm.all_reduce(residual)


class LinearOProj(LinearRowParallel):
    """The attention output projection: row-parallel, like down_proj."""


def warm_up_gemms(model: BaseOP, row_counts: Iterable[int]) -> int:
    """Run every distinct projection once at each of ``row_counts`` (cuBLAS's first-call pick); returns their count."""
    layers: Dict[tuple, _LinearTPImpl] = {}
    for op in model.walk():
        if isinstance(op, _LinearTPImpl):
            w = op.weight
            layers.setdefault((type(op), tuple(w.shape), w.stride(), w.dtype, op.bias is None), op)
    counts = sorted(set(row_counts))
    if not counts:
        return 0
    for layer in layers.values():
        w = layer.weight
        x = torch.zeros(counts[-1], w.shape[1], dtype=w.dtype, device=w.device)
        residual = (torch.zeros(counts[-1], w.shape[0], dtype=w.dtype, device=w.device)
                    if isinstance(layer, LinearRowParallel) else None)
        for rows in counts:
            layer.warm_up_gemms(x[:rows], None if residual is None else residual[:rows])
    return len(layers)
