from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    max_extend_tokens: int = 8192  # prefill tokens per step; a longer prompt is chunked across steps
    cache_type: str = "radix"  # "naive" | "radix"
    offline_mode: bool = False
    # a decode step after a long prompt's lone chunk; off offline (a field: TP ranks must schedule alike)
    decode_between_chunks: bool = True
    enable_mixed_chunk: bool = False  # SGLang's: running requests decode inside each prefill batch (in its budget)
    stream_interval: int = 1  # SGLang's (scheduler/stream_interval.py); 1 = every token as it comes
    overlap_scheduling: bool = True  # a field; upstream has only MINISGL_DISABLE_OVERLAP_SCHEDULING (still read)
    # stage 3: makes the ipc:// addresses unique per server (the API server's pid; workers get a copy of the config)
    _unique_suffix: str = field(default_factory=lambda: f".pid={os.getpid()}")

    @property
    def zmq_backend_addr(self) -> str:  # tokenizer -> scheduler rank 0
        return "ipc:///tmp/minisgl_0" + self._unique_suffix

    @property
    def zmq_detokenizer_addr(self) -> str:  # scheduler rank 0 -> detokenizer
        return "ipc:///tmp/minisgl_1" + self._unique_suffix

    @property
    def zmq_scheduler_broadcast_addr(self) -> str:  # rank 0 -> ranks 1..tp-1
        return "ipc:///tmp/minisgl_2" + self._unique_suffix

    @property
    def backend_create_detokenizer_link(self) -> bool:
        return True
