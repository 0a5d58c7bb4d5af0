"""stage2_scheduled: stage1's engine driven by a scheduler — continuous batching, a radix prefix cache, chunked
prefill, overlap scheduling — and the offline `LLM.generate` API, matching HF token for token."""

from .core import Batch, Req, SamplingParams
from .engine import Engine, EngineConfig, ManualBatcher
from .llm import LLM
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Batch", "Engine", "EngineConfig", "LLM", "ManualBatcher", "Req", "SamplingParams", "Scheduler",
           "SchedulerConfig"]
