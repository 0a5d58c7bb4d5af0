from .config import EngineConfig
from .engine import Engine, ForwardOutput
from .graph import GraphRunner
from .manual import ManualBatcher
from .sample import BatchSamplingArgs, Sampler

__all__ = ["BatchSamplingArgs", "Engine", "EngineConfig", "ForwardOutput", "GraphRunner", "ManualBatcher", "Sampler"]
