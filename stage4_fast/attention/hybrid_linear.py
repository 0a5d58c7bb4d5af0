"""Hybrid-model attention backend: full-attention layers go to the wrapped backend, linear-attention layers (Qwen3.5's
gated DeltaNet) run the causal conv and gated delta rule against the per-request state pool. A state cannot be
rebuilt from KV pages: hybrid models use the naive prefix cache, and ``prepare_metadata`` checks each state's length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Tuple

import torch

from ..kernel import gated_delta as gd
from .base import BaseAttnBackend

# Decode through kernel/triton_gated_delta.py: None = on CUDA only (tests set True to interpret it on CPU)
TRITON_DECODE: bool | None = None

if TYPE_CHECKING:
    from ..core import Batch
    from ..kvcache.state_pool import LinearStatePool
    from ..models.hybrid_config import LinearAttnConfig


@dataclass
class LinearSegment:
    start: int  # token rows of one request in the flattened batch
    end: int
    slot: int  # its state slot
    fresh: bool  # first prefill: start from a zero state instead of reading the slot


@dataclass
class LinearAttnMetadata:
    slots: torch.Tensor  # [padded bs] int64 on the device: each request's state slot (decode gathers with it)
    is_decode: bool
    segments: List[LinearSegment] | None = None  # prefill only


class HybridLinearAttnBackend(BaseAttnBackend):
    def __init__(self, full_backend: BaseAttnBackend, state_pool: LinearStatePool, config: LinearAttnConfig):
        self.full, self.state_pool, self.config, self.device = full_backend, state_pool, config, state_pool.device
        # host: how many tokens each slot's state has absorbed (the check in prepare_metadata)
        self._state_len = [0] * state_pool.num_slots
        self._capture_slots: torch.Tensor | None = None
        self.triton_decode = self.device.type == "cuda" if TRITON_DECODE is None else TRITON_DECODE

    def prepare_metadata(self, batch: Batch) -> None:
        self.full.prepare_metadata(batch)
        for req in batch.reqs:  # padding rows (the dummy request) are not tracked
            if req.cached_len != 0 and self._state_len[req.table_idx] != req.cached_len:
                raise RuntimeError(f"request {req.uid}: the linear-attention state holds "
                                   f"{self._state_len[req.table_idx]} tokens, the batch expects {req.cached_len}; "
                                   "prefix reuse must be off for hybrid models")
            self._state_len[req.table_idx] = req.device_len  # after this forward
        reqs = batch.padded_reqs
        slots = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64).to(self.device, non_blocking=True)
        if batch.is_decode:
            batch.state_metadata = LinearAttnMetadata(slots=slots, is_decode=True)
            return
        segments, start = [], 0
        for r in reqs:
            segments.append(LinearSegment(start, start + r.extend_len, r.table_idx, r.cached_len == 0))
            start += r.extend_len
        batch.state_metadata = LinearAttnMetadata(slots=slots, is_decode=False, segments=segments)

    # CUDA graphs (decode): slots come from a fixed buffer
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.full.init_capture_graph(max_seq_len, bs_list)
        dummy_slot = self.state_pool.num_slots - 1
        self._capture_slots = torch.full((max(bs_list),), dummy_slot, dtype=torch.int64, device=self.device)

    def prepare_for_capture(self, batch: Batch) -> None:
        assert self._capture_slots is not None, "init_capture_graph first"
        self.full.prepare_for_capture(batch)
        batch.state_metadata = LinearAttnMetadata(slots=self._capture_slots[: batch.padded_size], is_decode=True)

    def prepare_for_replay(self, batch: Batch) -> None:
        assert self._capture_slots is not None, "init_capture_graph first"
        self.full.prepare_for_replay(batch)
        self._capture_slots[: batch.padded_size].copy_(batch.state_metadata.slots)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        return self.full.forward(q, k, v, layer_id, batch, kv_stored)

    def forward_linear(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                       layer_id: int, batch: Batch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim] (before the conv), g / beta [T, v_heads], conv_weight [conv_dim, K] ->
        [T, v_heads, Dv], updating each request's state in the pool."""
        meta: LinearAttnMetadata = batch.state_metadata
        cfg = self.config
        conv_pool, ssm_pool = self.state_pool.conv_state(layer_id), self.state_pool.ssm_state(layer_id)
        if meta.is_decode:
            x, conv_new = gd.causal_conv1d_update(mixed_qkv, conv_weight, conv_pool[meta.slots])
            conv_pool[meta.slots] = conv_new.to(conv_pool.dtype)
            if self.triton_decode:  # the state is updated in place in the pool, no gather/scatter copies
                from ..kernel.triton_gated_delta import recurrent_gated_delta_rule_inplace

                return recurrent_gated_delta_rule_inplace(x, g, beta, ssm_pool, meta.slots, cfg.num_k_heads,
                                                          cfg.head_k_dim)
            q, k, v = self._split(x)
            o, ssm_new = gd.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_pool[meta.slots])
            ssm_pool[meta.slots] = ssm_new
            return o.to(mixed_qkv.dtype)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], cfg.num_v_heads, cfg.head_v_dim)
        for seg in meta.segments or []:
            s, e = seg.start, seg.end
            conv_in = None if seg.fresh else conv_pool[seg.slot]
            x, conv_new = gd.causal_conv1d_prefill(mixed_qkv[s:e], conv_weight, conv_in)
            conv_pool[seg.slot] = conv_new
            q, k, v = self._split(x)
            state = None if seg.fresh else ssm_pool[seg.slot]
            o, ssm_new = gd.chunk_gated_delta_rule(q, k, v, g[s:e], beta[s:e], state)
            ssm_pool[seg.slot] = ssm_new
            out[s:e] = o
        return out

    def _split(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, T = self.config, x.shape[0]
        q, k, v = x.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        return (q.reshape(T, cfg.num_k_heads, cfg.head_k_dim), k.reshape(T, cfg.num_k_heads, cfg.head_k_dim),
                v.reshape(T, cfg.num_v_heads, cfg.head_v_dim))
