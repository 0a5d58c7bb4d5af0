"""``--kv-cache-dtype``: the names SGLang and vLLM use for what the KV pool stores, and what each costs per token."""

from __future__ import annotations

from typing import Dict

import torch

from ..kernel.ref import is_fp8

# "auto" is the model's dtype; fp8_e4m3 (largest 448) is the usual KV choice, fp8_e5m2 trades a mantissa bit for range
KV_CACHE_DTYPES: Dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype name`` (``auto``: the model's own dtype)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in KV_CACHE_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


__all__ = ["KV_CACHE_DTYPES", "KV_CACHE_DTYPE_CHOICES", "is_fp8", "kv_cache_dtype_name", "resolve_kv_cache_dtype"]
