"""stage4_fast: the stage-3 server made fast — tensor parallelism, FlashInfer / FlashAttention / Triton attention
backends, CUDA graphs (emulated on CPU), JIT CUDA and Triton kernels, Qwen3-MoE — still matching HF token for token.
Run it with `python -m stage4_fast.serve` (or `python -m stage4_fast`, upstream's CLI)."""

from .core import Batch, Req, SamplingParams
from .engine import Engine, EngineConfig, ManualBatcher
from .llm import LLM
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Batch", "Engine", "EngineConfig", "LLM", "ManualBatcher", "Req", "SamplingParams", "Scheduler",
           "SchedulerConfig"]
