from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    max_extend_tokens: int = 8192  # prefill tokens per step; a longer prompt is chunked across steps
    cache_type: str = "radix"  # "naive" | "radix"
    offline_mode: bool = False
    overlap_scheduling: bool = True  # a field; upstream has only MINISGL_DISABLE_OVERLAP_SCHEDULING (still read)
