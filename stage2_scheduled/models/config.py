"""Model shape parsed from an HF config (PretrainedConfig or the raw config.json dict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple


@dataclass(frozen=True)
class RotaryConfig:
    head_dim: int
    rotary_dim: int
    max_position: int
    base: float
    scaling: Dict[str, Any] | None  # None for plain RoPE


def _rope_settings(cfg: Dict[str, Any]) -> Tuple[float, Dict[str, Any] | None]:
    """(theta, scaling). transformers 5 writes `rope_parameters = {rope_theta, rope_type, ...}`; older configs have
    a top-level `rope_theta` plus an optional `rope_scaling` dict (whose type key was once `type`)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        scaling = dict(cfg.get("rope_scaling") or {})
        # Mistral-style configs keep theta inside rope_scaling
        theta = float(cfg.get("rope_theta", scaling.pop("rope_theta", 10000.0)))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return theta, None if scaling.get("rope_type", "default") == "default" else scaling


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    rotary_config: RotaryConfig
    hidden_act: str
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    model_type: str
    architectures: List[str]

    @property
    def is_moe(self) -> bool:
        return "moe" in self.model_type

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        cfg: Dict[str, Any] = config if isinstance(config, dict) else config.to_dict()
        text = cfg.get("text_config")
        if isinstance(text, dict):  # multimodal wrapper: the language model's fields, top-level ones as fallback
            cfg = {**{k: cfg[k] for k in ("architectures", "rope_theta", "rope_scaling") if k in cfg}, **text}
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        theta, scaling = _rope_settings(cfg)
        return cls(
            num_layers=cfg["num_hidden_layers"], num_qo_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rotary_config=RotaryConfig(
                head_dim=head_dim,
                rotary_dim=head_dim,
                max_position=cfg["max_position_embeddings"],
                base=theta,
                scaling=scaling,
            ),
            hidden_act=cfg.get("hidden_act", "silu"), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=cfg.get("num_local_experts") or cfg.get("num_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), model_type=cfg.get("model_type", "llama"),
            architectures=list(cfg.get("architectures") or ["LlamaForCausalLM"]),
        )
