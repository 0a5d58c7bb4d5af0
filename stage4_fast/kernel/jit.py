"""JIT build of the CUDA kernels (``csrc/``) with torch's extension loader (upstream: tvm-ffi), once per process;
a failed build is reported once and callers fall back to the torch reference."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
CUDA_SOURCES = ("store_cache.cu", "store_cache_fp8.cu", "indexing.cu", "decode_fp8.cu")
MODULE_NAME = "stage4_fast_kernels"

logger = logging.getLogger(__name__)


@functools.cache
def load_cuda_kernels() -> ModuleType | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name=MODULE_NAME, sources=[str(CSRC / "binding.cpp"), *(str(CSRC / f) for f in CUDA_SOURCES)],
                    extra_cflags=["-O3", "-std=c++17"],
                    extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr"],
                    extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as e:  # no nvcc/ninja, or a compile error: the torch reference still works
        logger.warning("CUDA kernels could not be built (%s); using the torch reference", e)
        return None
