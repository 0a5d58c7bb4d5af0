"""Attention backends (``torch`` reference, ``triton``, ``fi`` FlashInfer, ``fa`` FlashAttention 4) and the
``--attn PREFILL[,DECODE]`` factory. GPU backends import their library only when built."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Callable

import torch

from ..kvcache.dtype import kv_cache_dtype_name
from ..utils import Registry
from .base import BaseAttnBackend, BaseAttnMetadata, HybridBackend
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from ..models import ModelConfig

logger = logging.getLogger(__name__)


def _lazy(module: str, name: str) -> Callable[[ModelConfig], BaseAttnBackend]:
    return lambda config: getattr(importlib.import_module(f".{module}", __package__), name)(config)


SUPPORTED_ATTENTION_BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")
SUPPORTED_ATTENTION_BACKENDS.register("torch")(TorchBackend)
SUPPORTED_ATTENTION_BACKENDS.register("triton")(_lazy("triton", "TritonBackend"))
SUPPORTED_ATTENTION_BACKENDS.register("fi")(_lazy("fi", "FlashInferBackend"))
SUPPORTED_ATTENTION_BACKENDS.register("fa")(_lazy("fa", "FlashAttentionBackend"))


def validate_attn_backend(backend: str, allow_auto: bool = True) -> str:
    """"auto", one name, or "prefill,decode"."""
    if backend == "auto" and allow_auto:
        return backend
    names = backend.split(",")
    if len(names) > 2 or not all(names):
        raise ValueError(f"attention backend must be NAME or PREFILL,DECODE, got {backend!r}")
    SUPPORTED_ATTENTION_BACKENDS.assert_supported(names)
    return backend


# backends that read a pool stored in another dtype than the queries', and which storage dtypes they take
_CONVERTING_READS: dict[str, Callable[[torch.dtype, torch.dtype], bool]] = {
    "torch": lambda q, kv: True,
    "triton": lambda q, kv: True,
    # FlashInfer's kernels take fp8 pages under fp16/bf16 queries (kv_data_type in plan, scales in run)
    "fi": lambda q, kv: kv in (torch.float8_e4m3fn, torch.float8_e5m2) and q in (torch.float16, torch.bfloat16),
}


def kv_cache_dtype_problem(backend: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why ``backend`` ("NAME" or "PREFILL,DECODE") cannot read a ``kv_dtype`` pool under a ``dtype`` model, or None."""
    if kv_dtype == dtype:
        return None
    for name in backend.split(","):
        if not _CONVERTING_READS.get(name, lambda q, kv: False)(dtype, kv_dtype):
            able = ", ".join(n for n, ok in _CONVERTING_READS.items() if ok(dtype, kv_dtype))
            return (f"attention backend {name!r} cannot read KV stored as {kv_cache_dtype_name(kv_dtype)} in a "
                    f"{kv_cache_dtype_name(dtype)} model; backends that can: {able}")
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a parent package that fails to import counts as absent
        return False


def resolve_auto_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                         kv_dtype: torch.dtype | None = None) -> str:
    """CPU: torch. GPU: triton, with FA 4 for prefill on sm90+ when installed (upstream's "fa,fi"; our Triton
    decode is faster than FlashInfer's, so "fi" is only on request). fp32 or a KV pool of another dtype: triton."""
    if device.type != "cuda":
        return "torch"
    if dtype not in (torch.float16, torch.bfloat16) or (kv_dtype is not None and kv_dtype != dtype):
        return "triton"
    if _installed("flash_attn.cute") and torch.cuda.get_device_capability(device)[0] >= 9:
        return "fa,triton"
    return "triton"


def create_attention_backend(backend: str, config: ModelConfig) -> BaseAttnBackend:
    """Backends read ctx.kv_cache and ctx.page_table when built: create the pool first."""
    names = backend.split(",")
    if len(names) == 2 and names[0] == names[1]:
        logger.warning("prefill and decode backends are both %r: using one backend", names[0])
        names = names[:1]
    if len(names) == 1:
        return SUPPORTED_ATTENTION_BACKENDS[names[0]](config)
    return HybridBackend(SUPPORTED_ATTENTION_BACKENDS[names[0]](config), SUPPORTED_ATTENTION_BACKENDS[names[1]](config))


__all__ = ["SUPPORTED_ATTENTION_BACKENDS", "BaseAttnBackend", "BaseAttnMetadata", "HybridBackend",
           "create_attention_backend", "kv_cache_dtype_problem", "resolve_auto_backend", "validate_attn_backend"]
