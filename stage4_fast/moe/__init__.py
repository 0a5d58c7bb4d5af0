"""MoE backends: ``fused`` (Triton grouped GEMM, the GPU default; ``fused_sorted`` its ablation) and ``torch``
(reference, the CPU default)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..utils import Registry
from .base import BaseMoeBackend, FusedMoe, TorchMoe
from .topk import fused_topk

SUPPORTED_MOE_BACKENDS: Registry[Callable[[], BaseMoeBackend]] = Registry("MoE backend")
SUPPORTED_MOE_BACKENDS.register("fused")(FusedMoe)
SUPPORTED_MOE_BACKENDS.register("fused_sorted")(functools.partial(FusedMoe, few_token_path=False))
SUPPORTED_MOE_BACKENDS.register("torch")(TorchMoe)


def resolve_auto_moe_backend(device: torch.device) -> str:
    """Upstream's auto is "fused"; on CPU the Triton kernel would only run under the (slow) interpreter."""
    return "fused" if device.type == "cuda" else "torch"


def create_moe_backend(backend: str) -> BaseMoeBackend:
    return SUPPORTED_MOE_BACKENDS[backend]()


__all__ = ["SUPPORTED_MOE_BACKENDS", "BaseMoeBackend", "create_moe_backend", "fused_topk", "resolve_auto_moe_backend"]
