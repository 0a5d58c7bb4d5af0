from .base import BaseLLMModel
from .config import ModelConfig, RotaryConfig
from .register import MODEL_REGISTRY, create_model, get_model_class
from .weight import load_weight

__all__ = ["MODEL_REGISTRY", "BaseLLMModel", "ModelConfig", "RotaryConfig", "create_model", "get_model_class",
           "load_weight"]
