"""The linear-attention part of a hybrid model's config (Qwen3.5: gated DeltaNet layers among full-attention ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class LinearAttnConfig:
    layer_types: Tuple[str, ...]  # per decoder layer: "linear_attention" | "full_attention"
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @classmethod
    def from_hf(cls, cfg: Dict[str, Any]) -> LinearAttnConfig | None:
        """None for a model without linear-attention layers."""
        types = cfg.get("layer_types")
        if not types or LINEAR not in types:
            return None
        unknown = set(types) - {LINEAR, FULL}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        return cls(layer_types=tuple(types), conv_kernel=cfg["linear_conv_kernel_dim"],
                   num_k_heads=cfg["linear_num_key_heads"], num_v_heads=cfg["linear_num_value_heads"],
                   head_k_dim=cfg["linear_key_head_dim"], head_v_dim=cfg["linear_value_head_dim"])

    def is_linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    def sub_index(self, layer_id: int) -> int:
        """Index of a layer among the layers of its own kind: its KV-pool layer (full) or state-pool layer (linear)."""
        return sum(t == self.layer_types[layer_id] for t in self.layer_types[:layer_id])

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return len(self.layer_types) - self.num_linear_layers

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the conv runs over the concatenated [q | k | v] projection
        return 2 * self.key_dim + self.value_dim
