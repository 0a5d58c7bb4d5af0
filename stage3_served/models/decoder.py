"""One pre-norm decoder skeleton for Llama, Qwen2 and Qwen3; they differ only in the attention block's options.

Parameter names follow HF after fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj): `model.layers.3.mlp.gate_up_proj`.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..core import get_global_ctx
from ..layers import BaseOP, OPList, ParallelLMHead, RMSNormFused, VocabParallelEmbedding
from .base import BaseLLMModel
from .config import ModelConfig
from .utils import GatedMLP, RopeAttn


class DecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool, has_qk_norm: bool):
        self.self_attn = RopeAttn(config, layer_id, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class DecoderModel(BaseOP):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool, has_qk_norm: bool):
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList([DecoderLayer(config, i, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
                              for i in range(config.num_layers)])
        self.norm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens.forward(input_ids), None
        for layer in self.layers.op_list:
            x, residual = layer.forward(x, residual)
        return self.norm.forward(x, residual)[0]  # the final norm folds in the last residual


class DecoderForCausalLM(BaseLLMModel):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool = False, has_qk_norm: bool = False):
        self.model = DecoderModel(config, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tie_word_embeddings=tied,
                                      tied_embedding=self.model.embed_tokens if tied else None)

    def forward(self) -> torch.Tensor:
        return self.lm_head.forward(self.model.forward(get_global_ctx().batch.input_ids))
