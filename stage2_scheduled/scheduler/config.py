from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    max_extend_tokens: int = 8192  # prefill tokens per step; a longer prompt is chunked across steps
    cache_type: str = "radix"  # "naive" | "radix"
    offline_mode: bool = False
    # Upstream switches overlap scheduling only through MINISGL_DISABLE_OVERLAP_SCHEDULING; a field lets one process
    # hold schedulers of both kinds (tests). The environment variable still turns it off.
    overlap_scheduling: bool = True

    @property
    def max_forward_len(self) -> int:
        return self.max_extend_tokens
