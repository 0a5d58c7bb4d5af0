from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    max_extend_tokens: int = 8192  # prefill tokens per step; a longer prompt is chunked across steps
    cache_type: str = "radix"  # "naive" | "radix"
    offline_mode: bool = False
    # Right after a step that was a long prompt's chunk alone, a decode step for the running requests before the
    # next chunk, so that their tokens keep coming while the prompt goes in (a server's clients are reading them).
    # A step of several prompts that ends in a cut one is followed by the next prefill step, as in SGLang. The
    # offline LLM turns it off: nobody reads tokens as they come, and each decode step between chunks leaves the
    # GPU idle while the host finishes one prefill step and prepares the next. A
    # field, not offline_mode, because tensor-parallel ranks must schedule alike and only rank 0 is the offline LLM.
    decode_between_chunks: bool = True
    # SGLang's --enable-mixed-chunk: the running requests take their decode step inside each prefill batch (one
    # query token each, attending to their KV in the pool; a hybrid model's linear layers continue from the carried
    # state as for a prompt's next chunk) instead of in steps of their own, so a burst of prompts neither stalls
    # them nor alternates prefill and decode steps. The prefill budget counts their tokens.
    enable_mixed_chunk: bool = False
    # SGLang's --stream-interval: a request's tokens go to the detokenizer every N steps, its first and last at once
    # (scheduler/stream_interval.py); 1 = every token as it comes
    stream_interval: int = 1
    # Upstream switches overlap scheduling only through MINISGL_DISABLE_OVERLAP_SCHEDULING; a field lets one process
    # hold schedulers of both kinds (tests). The environment variable still turns it off.
    overlap_scheduling: bool = True
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

    @property
    def max_forward_len(self) -> int:
        return self.max_extend_tokens
