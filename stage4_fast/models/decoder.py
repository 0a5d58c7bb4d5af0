"""One pre-norm decoder skeleton for Llama, Qwen2, Qwen3 and Qwen3-MoE; they differ only in the attention block's
options and, for MoE models, a sparse MLP on the layers HF makes sparse (`ModelConfig.is_sparse_layer`; upstream
puts one on every layer and cannot load a model with dense layers).

Parameter names follow HF after fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj), e.g.
`model.layers.3.self_attn.qkv_proj.weight`.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..core import get_global_ctx
from ..layers import BaseOP, OPList, ParallelLMHead, RMSNormFused, VocabParallelEmbedding
from .base import BaseLLMModel
from .config import ModelConfig
from .utils import GatedMLP, MoEMLP, RopeAttn


class DecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool, has_qk_norm: bool):
        self.self_attn = RopeAttn(config, layer_id, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
        self.mlp = MoEMLP(config) if config.is_sparse_layer(layer_id) else GatedMLP(config)
        self.input_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] == 1 and isinstance(self.mlp, GatedMLP):
            return self._forward_one_token(x, residual)
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual

    def _forward_one_token(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The same layer for one token (single-stream decode): each add-RMSNorm goes with the projection that
        reads it, so that a 16-bit GPU forward folds it into that projection's GEMV (two kernels less per layer;
        elsewhere the same ops as ``forward``)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_after_norm(self.input_layernorm, x, residual)
        x = attn.o_proj.forward(attn.attn.forward(qkv))
        gate_up, residual = mlp.gate_up_proj.forward_after_norm(self.post_attention_layernorm, x, residual)
        return mlp.down_proj.forward(gate_up, silu_mul_input=True), residual


class DecoderModel(BaseOP):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool, has_qk_norm: bool):
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList(
            [
                DecoderLayer(config, i, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens.forward(input_ids), None
        for layer in self.layers.op_list:
            x, residual = layer.forward(x, residual)
        return self.norm.forward(x, residual)[0]  # the final norm folds in the last residual


class DecoderForCausalLM(BaseLLMModel):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool = False, has_qk_norm: bool = False):
        self._attach(config, DecoderModel(config, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm))

    def _attach(self, config: ModelConfig, model: DecoderModel) -> None:
        """The decoder stack and the LM head on top of it (tied to its embedding when the config says so); a model
        with other layers (the Qwen3.5 hybrid) passes its own stack."""
        self.model = model
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            tie_word_embeddings=tied,
            tied_embedding=self.model.embed_tokens if tied else None,
        )

    def forward(self) -> torch.Tensor:
        return self.lm_head.forward(self.model.forward(get_global_ctx().batch.input_ids))
