"""Qwen3.5 (text): a hybrid decoder. Most layers are gated DeltaNet linear attention (a causal conv plus a gated
delta-rule memory per request); every few layers one is full attention (gated query, partial RoPE, q/k norm).

Parameter names follow HF; real checkpoints wrap the text model (`model.language_model.*`), whose weights are
renamed (vision tower and multi-token-prediction head dropped). As HF: every RMSNorm scales by ``1 + weight``; full
attention gates its output by sigmoid(gate) and ropes a ``partial_rotary_factor`` of each head; the linear
attention's output (recurrence: ``kernel/gated_delta.py``) is RMS-normed per head and gated by silu(z). Under TP the
linear-attention layers are replicated (no communication, no sharding rule)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from ..attention.hybrid_linear import HybridLinearAttnBackend
from ..core import get_global_ctx
from ..distributed import get_tp_info
from ..layers import BaseOP, LinearOProj, LinearQKVMerged, LinearReplicated, OPList, VocabParallelEmbedding, get_rope
from ..layers.norm import RMSNorm, rms_norm
from ..utils import div_even
from .config import ModelConfig
from .decoder import DecoderForCausalLM, DecoderModel
from .hybrid_config import LinearAttnConfig
from .utils import GatedMLP


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), the residual add folded in: returns (norm(x + residual), x + residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual.add_(x)
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight, self.eps)


class GatedRMSNorm(RMSNorm):
    """Per-head RMSNorm of the delta-rule output, times silu(z) (HF's Qwen3_5RMSNormGated)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.weight, self.eps) * F.silu(gate.float())).to(x.dtype)


class ConvWeight(BaseOP):
    """Holds the depthwise conv's checkpoint tensor [conv_dim, 1, K] under its HF name `conv1d.weight`."""

    def __init__(self, channels: int, kernel: int):
        self.weight = torch.empty(channels, 1, kernel)

    def forward(self) -> torch.Tensor:
        return self.weight[:, 0, :]  # [conv_dim, K]


class GatedDeltaNet(BaseOP):
    def __init__(self, config: ModelConfig, lin: LinearAttnConfig, state_layer_id: int):
        self.state_layer_id = state_layer_id  # this layer's index in the state pool
        H = config.hidden_size
        self.in_proj_qkv = LinearReplicated(H, lin.conv_dim, has_bias=False)
        self.in_proj_z = LinearReplicated(H, lin.value_dim, has_bias=False)
        self.in_proj_b = LinearReplicated(H, lin.num_v_heads, has_bias=False)
        self.in_proj_a = LinearReplicated(H, lin.num_v_heads, has_bias=False)
        self.conv1d = ConvWeight(lin.conv_dim, lin.conv_kernel)
        self.A_log = torch.empty(lin.num_v_heads)
        self.dt_bias = torch.empty(lin.num_v_heads)
        self.norm = GatedRMSNorm(lin.head_v_dim, config.rms_norm_eps)
        self.out_proj = LinearReplicated(lin.value_dim, H, has_bias=False)
        self._num_v_heads, self._head_v_dim = lin.num_v_heads, lin.head_v_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        backend = ctx.attn_backend
        assert isinstance(backend, HybridLinearAttnBackend), "a hybrid model needs the hybrid attention backend"
        T = x.shape[0]
        mixed_qkv = self.in_proj_qkv.forward(x)
        z = self.in_proj_z.forward(x).view(T, self._num_v_heads, self._head_v_dim)
        beta = self.in_proj_b.forward(x).sigmoid()
        # log decay in fp32 (as HF: exp(A_log) can overflow 16-bit types)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a.forward(x).float() + self.dt_bias.float())
        core = backend.forward_linear(mixed_qkv, g, beta, self.conv1d.forward(), self.state_layer_id, ctx.batch)
        out = self.norm.forward(core, z)
        return self.out_proj.forward(out.reshape(T, self._num_v_heads * self._head_v_dim))


class GatedRopeAttn(BaseOP):
    """Full attention with an output gate and partial RoPE: q_proj's rows are [q_h | gate_h] (twice the query heads)."""

    def __init__(self, config: ModelConfig, kv_layer_id: int, has_attn_bias: bool):
        tp = get_tp_info().size
        D = config.head_dim
        self.kv_layer_id = kv_layer_id  # this layer's index in the KV pool (full-attention layers only)
        self.qkv_proj = LinearQKVMerged(config.hidden_size, D, 2 * config.num_qo_heads, config.num_kv_heads,
                                        has_bias=has_attn_bias)
        self.q_norm = OffsetRMSNorm(D, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, config.rms_norm_eps)
        self.o_proj = LinearOProj(config.num_qo_heads * D, config.hidden_size, has_bias=has_attn_bias)
        self._heads = div_even(config.num_qo_heads, tp)
        self._kv_heads = div_even(config.num_kv_heads, tp, allow_replicate=True)
        self._head_dim = D
        rc = config.rotary_config
        self._rotary_dim = rc.rotary_dim
        # RoPE over the first rotary_dim channels only: a rotary op of that width, applied to that slice
        self._rotary = get_rope(rc.rotary_dim, rc.rotary_dim, rc.max_position, rc.base,
                                tuple(sorted(rc.scaling.items())) if rc.scaling else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        T, Hq, Hkv, D, R = x.shape[0], self._heads, self._kv_heads, self._head_dim, self._rotary_dim
        qg, k, v = self.qkv_proj.forward(x).split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, gate = qg.view(T, Hq, 2 * D).split([D, D], dim=-1)
        qk = torch.cat([self.q_norm.norm(q), self.k_norm.norm(k.view(T, Hkv, D))], dim=1)  # [T, Hq + Hkv, D]
        if R < D:
            rotated, _ = self._rotary.forward(ctx.batch.positions, qk[..., :R])
            qk = torch.cat([rotated, qk[..., R:]], dim=-1)
        else:
            qk, _ = self._rotary.forward(ctx.batch.positions, qk)
        o = ctx.attn_backend.forward(qk[:, :Hq], qk[:, Hq:], v.view(T, Hkv, D), self.kv_layer_id, ctx.batch)
        o = o.reshape(T, Hq * D) * torch.sigmoid(gate.reshape(T, Hq * D))
        return self.o_proj.forward(o)


class HybridDecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int):
        lin = config.linear_attn
        if lin.is_linear(layer_id):
            self.linear_attn = GatedDeltaNet(config, lin, lin.sub_index(layer_id))
        else:
            self.self_attn = GatedRopeAttn(config, lin.sub_index(layer_id), has_attn_bias=False)
        self.mlp = GatedMLP(config)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._mixer: BaseOP = self.linear_attn if lin.is_linear(layer_id) else self.self_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> Tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)
        x = self._mixer.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class HybridDecoderModel(DecoderModel):
    """The dense decoder's stack (embedding, layers, final norm; its forward) with hybrid layers and offset norms."""

    def __init__(self, config: ModelConfig):  # (DecoderModel.__init__ is not called: every field is set here)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList([HybridDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig):
        if config.linear_attn is None:
            raise ValueError("Qwen3.5 needs layer_types and the linear_* fields in its config")
        self._attach(config, HybridDecoderModel(config))

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], *, prefix: str = "",
                        _internal: bool = False) -> None:
        if not _internal:
            state_dict = _text_weights(state_dict)
        super().load_state_dict(state_dict, prefix=prefix, _internal=_internal)


def _text_weights(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The multimodal checkpoint's language model under the text model's names; vision tower and MTP dropped."""
    out: Dict[str, torch.Tensor] = {}
    for key in list(state_dict):
        value = state_dict.pop(key)
        if key.startswith(("model.visual.", "mtp.", "visual.")):
            continue
        out[key.replace("model.language_model.", "model.", 1)] = value
    return out
