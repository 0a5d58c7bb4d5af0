"""Rotary position embedding, half-split ("neox") pairing: dimension i rotates with i + d/2, as HF Llama/Qwen do."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Tuple

import torch

from .base import StateLessOP


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))


def _llama3_post_process(scaling: Dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Llama 3.1 context extension: short wavelengths unchanged, long ones divided by `factor`, a blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]

    def post_process(inv_freq: torch.Tensor) -> torch.Tensor:
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        if low == high:  # no blend band: a hard switch
            return scaled
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, blended, scaled)

    return post_process


def _linear_post_process(scaling: Dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda inv_freq: inv_freq / scaling["factor"]


class RotaryEmbedding(StateLessOP):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 post_process: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | str = "cpu"):
        # Partial rotary (rotary_dim < head_size) is not needed by the supported models.
        assert rotary_dim == head_size, "partial rotary embedding is not supported"
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq = _default_inv_freq(rotary_dim, base)
        if post_process is not None:
            inv_freq = post_process(inv_freq)
        self.inv_freq = inv_freq
        positions = torch.arange(max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # fp32, as HF computes them
        # [max_pos, rotary_dim] = cos | sin (each rotary_dim / 2 wide); private, so never saved or loaded
        self._cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
        # Every layer shares this op and sees the same positions tensor during one forward, so the gather of
        # cos/sin happens once per forward instead of once per layer. Assumes positions are not mutated in place.
        self._memo: Tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] tables (cos | cos) and (-sin | sin) for these positions, so that rotating is
        x * cos + roll(x, d/2) * sin: the same products and sums as HF's q * cos + rotate_half(q) * sin."""
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return memo[2], memo[3]
        cos, sin = self._cos_sin_cache[positions].to(dtype)[:, None, :].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        self._memo = (positions, dtype, cos, sin)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.rotary_dim // 2, dims=-1) * sin

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor | None]:
        """query/key: [T, heads, head_size] -> rotated copies (upstream rotates in place with a FlashInfer kernel).
        key may be None when the caller stacked the q and k heads into query: one pass instead of two."""
        cos, sin = self._cos_sin(positions, query.dtype)
        return self._rotate(query, cos, sin), (None if key is None else self._rotate(key, cos, sin))


_POST_PROCESS = {"default": None, "llama3": _llama3_post_process, "linear": _linear_post_process}
_ROPE_DEVICE: torch.device | None = None


def set_rope_device(device: torch.device) -> None:
    """Where get_rope builds its cache (the model itself is built on the meta device)."""
    global _ROPE_DEVICE
    _ROPE_DEVICE = device


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: Tuple[Tuple[str, Any], ...] | None = None) -> RotaryEmbedding:
    """One shared instance per (parameters, device); rope_scaling is the scaling dict as sorted items (hashable)."""
    device = _ROPE_DEVICE if _ROPE_DEVICE is not None else torch.device("cpu")
    return _get_rope(head_dim, rotary_dim, max_position, base, rope_scaling, device)


@functools.cache
def _get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
              rope_scaling: Tuple[Tuple[str, Any], ...] | None, device: torch.device) -> RotaryEmbedding:
    post_process = None
    if rope_scaling is not None:
        scaling = dict(rope_scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _POST_PROCESS:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        make = _POST_PROCESS[rope_type]
        post_process = make(scaling) if make is not None else None
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, post_process, device)
