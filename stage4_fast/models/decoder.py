"""One pre-norm decoder skeleton for Llama, Qwen2, Qwen3 and Qwen3-MoE; they differ only in the attention block's
options and, for MoE models, a sparse MLP on the layers HF makes sparse (`ModelConfig.is_sparse_layer`; upstream
puts one on every layer and cannot load a model with dense layers).

Parameter names follow HF after fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj): `model.layers.3.mlp.gate_up_proj`.

Deferred norms (bf16 on a GPU): norm(h) W^T = r(h) * (h (W diag(w))^T) with r(h) = rsqrt(mean(h^2) + eps), so w
is folded into the projection, which reads the residual stream h, and the kernel after it applies r(h); with the
residual adds in the o and down GEMMs a layer has no norm kernel. fp32 and fp16 keep the norms (fp16's range is too
small for a projection of unnormalised rows).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..core import get_global_ctx
from ..kernel import fused_kernels_for
from ..layers import BaseOP, OPList, ParallelLMHead, RMSNormFused, VocabParallelEmbedding
from ..layers.activation import silu_and_mul
from .base import BaseLLMModel
from .config import ModelConfig
from .utils import GatedMLP, MoEMLP, RopeAttn


class DecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool, has_qk_norm: bool):
        self.self_attn = RopeAttn(config, layer_id, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
        self.mlp = MoEMLP(config) if config.is_sparse_layer(layer_id) else GatedMLP(config)
        self.input_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self.deferred_norms = False  # set by DecoderModel.defer_norms once the norm weights are folded

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor | None]:
        if x.shape[0] == 1 and isinstance(self.mlp, GatedMLP):
            return self._forward_one_token(x, residual)
        if self.deferred_norms:
            return self._forward_deferred(x, residual), None
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual

    def _forward_one_token(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The same layer for one token: each add-RMSNorm goes with the projection after it, which a 16-bit GPU
        forward folds into that projection's GEMV."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_after_norm(self.input_layernorm, x, residual)
        x = attn.o_proj.forward(attn.attn.forward(qkv))
        gate_up, residual = mlp.gate_up_proj.forward_after_norm(self.post_attention_layernorm, x, residual)
        return mlp.down_proj.forward(gate_up, silu_mul_input=True), residual

    def _forward_deferred(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The same layer with both norms deferred (module docstring): returns the residual stream after it."""
        h = x if residual is None else residual.add_(x)
        attn, mlp = self.self_attn, self.mlp
        o = attn.attn.forward(attn.qkv_proj.forward(h), row_scale=(h, self.input_layernorm.eps))
        h = attn.o_proj.forward_add(o, h)
        act = silu_and_mul(mlp.gate_up_proj.forward(h), row_scale=(h, self.post_attention_layernorm.eps))
        return mlp.down_proj.forward_add(act, h)


def deferred_norms_apply(layers: list) -> bool:
    """Whether a stack's norms are deferred: dense layers without a qkv bias (it would be scaled too), bf16 on a GPU."""
    if not layers:
        return False
    if not all(isinstance(layer, DecoderLayer) and isinstance(layer.mlp, GatedMLP)
               and layer.self_attn.qkv_proj.bias is None for layer in layers):
        return False
    return runs_deferred_norms(layers[0].self_attn.qkv_proj.weight)


def runs_deferred_norms(weight: torch.Tensor) -> bool:
    """Whether weights of this dtype and device take the deferred norms: bf16 that the fused kernels take."""
    return weight.dtype == torch.bfloat16 and fused_kernels_for(weight) is not None


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

    def defer_norms(self) -> None:
        """Fold each layer's norm weights into the projections after them (module docstring), the norms to unit."""
        for layer in self.layers.op_list:
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                proj.weight = (proj.weight.float() * norm.weight.float()).to(proj.weight.dtype)
                norm.weight = torch.ones_like(norm.weight)
            layer.deferred_norms = True


class DecoderForCausalLM(BaseLLMModel):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool = False, has_qk_norm: bool = False):
        self._attach(config, DecoderModel(config, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm))

    def _attach(self, config: ModelConfig, model: DecoderModel) -> None:
        """The decoder stack (the Qwen3.5 hybrid passes its own) and the LM head, tied to its embedding if so set."""
        self.model = model
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tie_word_embeddings=tied,
                                      tied_embedding=self.model.embed_tokens if tied else None)

    def after_load(self) -> None:
        if deferred_norms_apply(self.model.layers.op_list):
            self.model.defer_norms()

    def forward(self) -> torch.Tensor:
        return self.lm_head.forward(self.model.forward(get_global_ctx().batch.input_ids))
