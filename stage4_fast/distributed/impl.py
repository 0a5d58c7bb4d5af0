"""Collectives behind ``DistributedCommunicator``; upstream's torch.distributed plugin: NCCL on a GPU, gloo on CPU."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, List

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.11 has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistributedImpl(ABC):
    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``x``."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks along dim 0, rank-major: [size * x.shape[0], ...]."""


@dataclass
class TorchDistributedImpl(DistributedImpl):
    group: dist.ProcessGroup | None = None  # None = the default (world) group

    def _size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._size() > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        size = self._size()
        if size == 1:
            return x
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out


class DistributedCommunicator:
    """Stateless front door; the active implementation is the last plugin registered."""

    plugins: ClassVar[List[DistributedImpl]] = [TorchDistributedImpl()]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.plugins[-1].all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.plugins[-1].all_gather(x)


def destroy_distributed() -> None:
    """Drop the plugins and the process group (the engine's shutdown); a later engine starts afresh."""
    DistributedCommunicator.plugins = [TorchDistributedImpl()]
    if dist.is_initialized():
        dist.destroy_process_group()
