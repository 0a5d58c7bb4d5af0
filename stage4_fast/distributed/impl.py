"""The TP ranks' collectives over the default process group (upstream's torch.distributed plugin): NCCL on a GPU,
gloo on CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.11 has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class DistributedCommunicator:
    """Stateless: every call runs over the world group of the moment (one rank: a no-op)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``x``."""
        if _size() > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks along dim 0, rank-major: [size * x.shape[0], ...]."""
        size = _size()
        if size == 1:
            return x
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous())
        return out


def destroy_distributed() -> None:
    """Drop the process group (the engine's shutdown), so a later engine starts afresh."""
    if dist.is_initialized():
        dist.destroy_process_group()
