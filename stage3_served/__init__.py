"""stage3_served: stage2's scheduler behind an OpenAI-compatible HTTP server — API server, tokenizer/detokenizer and
scheduler processes connected by ZMQ, streaming, abort on disconnect — matching HF token for token.
Run it with `python -m stage3_served`."""

from .core import Batch, Req, SamplingParams
from .engine import Engine, EngineConfig, ManualBatcher
from .llm import LLM
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Batch", "Engine", "EngineConfig", "LLM", "ManualBatcher", "Req", "SamplingParams", "Scheduler",
           "SchedulerConfig"]
