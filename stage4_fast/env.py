"""Environment switches, read from MINISGL_<NAME> (as upstream)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default_value: T
    fn: Callable[[str], T]

    @property
    def value(self) -> T:
        # Read on every access (upstream reads once at import) so a test can flip it with monkeypatch.setenv.
        raw = os.getenv(f"MINISGL_{self.name}")
        if raw is None:
            return self.default_value
        try:
            return self.fn(raw)
        except ValueError:
            return self.default_value


def _parse_bool(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes")


class _Env:
    DISABLE_OVERLAP_SCHEDULING = EnvVar("DISABLE_OVERLAP_SCHEDULING", False, _parse_bool)
    # The scheduler checks its KV pages whenever it goes idle. The deep check walks the whole prefix cache and the
    # free list (~0.2 s at a million cached tokens), which a server idle between requests would make the next
    # request wait for; by default only the sizes are checked. The test suites switch it on (conftest.py).
    CHECK_CACHE_DEEP = EnvVar("CHECK_CACHE_DEEP", False, _parse_bool)
    # the fused Triton element-wise kernels of 16-bit GPU forwards (kernel/triton_fused.py), off for A/B measurements
    DISABLE_FUSED_KERNELS = EnvVar("DISABLE_FUSED_KERNELS", False, _parse_bool)
    # the Triton GEMV of one-token forwards (kernel/triton_gemv.py), off for A/B measurements
    DISABLE_GEMV = EnvVar("DISABLE_GEMV", False, _parse_bool)
    # that GEMV with the add-RMSNorm before it folded in (the qkv and gate_up projections), off for A/B measurements
    DISABLE_GEMV_NORM = EnvVar("DISABLE_GEMV_NORM", False, _parse_bool)
    # this step's K/V written into the pool by the fused q/k norm + RoPE kernel (else by the store kernel), for A/B
    DISABLE_FUSED_KV_STORE = EnvVar("DISABLE_FUSED_KV_STORE", False, _parse_bool)
    # the decoder's RMSNorms deferred into the kernels after their projections (models/decoder.py), off for A/B runs
    DISABLE_DEFERRED_NORMS = EnvVar("DISABLE_DEFERRED_NORMS", False, _parse_bool)
    # the scheduler's dummy prefill step of max_extend_tokens over several requests at start-up on a GPU
    # (Engine.warm_up_prefill) and its first scatter into the token pool, off for A/B
    DISABLE_PREFILL_WARM_UP = EnvVar("DISABLE_PREFILL_WARM_UP", False, _parse_bool)
    # the projections run at a grid of row counts at start-up on a GPU (Engine.warm_up_gemms), off for A/B runs
    DISABLE_GEMM_WARM_UP = EnvVar("DISABLE_GEMM_WARM_UP", False, _parse_bool)
    # a file the scheduler appends a JSON line per loop to (scheduler/step_log.py); unset: nothing is logged
    STEP_LOG = EnvVar("STEP_LOG", "", str)
    # greedy sampling's Triton argmax over 16-bit GPU logits (kernel/triton_argmax.py), off for A/B measurements
    DISABLE_TRITON_ARGMAX = EnvVar("DISABLE_TRITON_ARGMAX", False, _parse_bool)
    # programmatic dependent launch of the Triton kernels on Hopper GPUs (kernel/pdl.py), off for A/B measurements
    DISABLE_PDL = EnvVar("DISABLE_PDL", False, _parse_bool)
    # the Triton attention's dots over an fp8 KV cache under 16-bit queries: "fp16" (fp8 converts to it exactly and
    # cheaply; 8 % faster decode attention on the H200, bench/results/h200-history.md) or "q" (the queries' dtype),
    # for A/B runs
    TRITON_FP8_DOTS = EnvVar("TRITON_FP8_DOTS", "fp16", str)
    # sampling of the interactive shell (`--shell`). Upstream's defaults (temperature 0.6, 2048 tokens) make a small
    # model ramble for half a minute; greedy and 256 tokens answer briefly and the same way each time
    SHELL_MAX_TOKENS = EnvVar("SHELL_MAX_TOKENS", 256, int)
    SHELL_TOP_K = EnvVar("SHELL_TOP_K", -1, int)
    SHELL_TOP_P = EnvVar("SHELL_TOP_P", 1.0, float)
    SHELL_TEMPERATURE = EnvVar("SHELL_TEMPERATURE", 0.0, float)


ENV = _Env()
