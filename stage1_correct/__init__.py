"""stage1_correct: mini-sglang's formal structure (core / layers / models / kvcache / attention / engine) on CPU,
matching HF token for token, with batches over a paged KV cache."""

from .core import Batch, Req, SamplingParams
from .engine import Engine, EngineConfig, ManualBatcher

__all__ = ["Batch", "Engine", "EngineConfig", "ManualBatcher", "Req", "SamplingParams"]
