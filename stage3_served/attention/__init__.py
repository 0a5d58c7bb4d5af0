from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..utils import Registry
from .base import BaseAttnBackend, BaseAttnMetadata
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from ..models import ModelConfig

SUPPORTED_ATTENTION_BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")
SUPPORTED_ATTENTION_BACKENDS.register("torch")(TorchBackend)


def validate_attn_backend(backend: str, allow_auto: bool = True) -> str:
    if backend == "auto" and allow_auto:
        return backend
    SUPPORTED_ATTENTION_BACKENDS.assert_supported(backend.split(","))
    return backend


def create_attention_backend(backend: str, config: ModelConfig) -> BaseAttnBackend:
    """Backends read ctx.kv_cache and ctx.page_table when built: create the pool first."""
    names = backend.split(",")
    if len(set(names)) > 1:
        raise NotImplementedError("a prefill,decode backend pair arrives with the GPU backends")
    return SUPPORTED_ATTENTION_BACKENDS[names[0]](config)


__all__ = [
    "SUPPORTED_ATTENTION_BACKENDS",
    "BaseAttnBackend",
    "BaseAttnMetadata",
    "create_attention_backend",
    "validate_attn_backend",
]
