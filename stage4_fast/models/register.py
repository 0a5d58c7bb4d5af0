from __future__ import annotations

from typing import Callable

from ..utils import Registry
from .base import BaseLLMModel
from .config import ModelConfig
from .decoder import DecoderForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM

ModelFactory = Callable[[ModelConfig], BaseLLMModel]

# keyed by HF `architectures[0]`
MODEL_REGISTRY: Registry[ModelFactory] = Registry("model architecture")
MODEL_REGISTRY.register("LlamaForCausalLM")(lambda config: DecoderForCausalLM(config))
MODEL_REGISTRY.register("Qwen2ForCausalLM")(lambda config: DecoderForCausalLM(config, has_attn_bias=True))
MODEL_REGISTRY.register("Qwen3ForCausalLM")(lambda config: DecoderForCausalLM(config, has_qk_norm=True))
MODEL_REGISTRY.register("Qwen3MoeForCausalLM")(lambda config: DecoderForCausalLM(config, has_qk_norm=True))


def get_model_class(model_architecture: str, model_config: ModelConfig) -> BaseLLMModel:
    """Despite the upstream name, returns an instance (build it under torch.device('meta'))."""
    return MODEL_REGISTRY[model_architecture](model_config)


def create_model(model_config: ModelConfig) -> BaseLLMModel:
    return get_model_class(model_config.architectures[0], model_config)
# hybrid linear/full attention; the multimodal wrapper's text weights are renamed on load
MODEL_REGISTRY.register("Qwen3_5ForCausalLM")(Qwen3_5ForCausalLM)
MODEL_REGISTRY.register("Qwen3_5ForConditionalGeneration")(Qwen3_5ForCausalLM)
