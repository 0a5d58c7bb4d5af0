"""CUDA graphs of the decoder stack's prefill forward at a grid of token counts up to ``max_extend_tokens``: eagerly,
launching a small model's kernels takes the host about as long as the device's step. One graph serves every batch of
its count (the Triton prefill kernel reads its work list from the device, ``prefill_block_map``); a step is padded up
with dummy prompts in the padding row, and the LM head runs eagerly on the graph's hidden states."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Sequence

import torch

from ..core import Batch, Req, SamplingParams, get_global_ctx
from ..utils.device import Stream, is_cuda, stream_context, synchronize
from .graph import Graph, capture_graph, rewires_graphs

if TYPE_CHECKING:
    from ..attention import BaseAttnBackend
    from ..models import BaseLLMModel

logger = logging.getLogger(__name__)


@dataclass
class PrefillCaptureBuffer:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    out_loc: torch.Tensor  # [num_tokens] int32

    @classmethod
    def init(cls, num_tokens: int, device: torch.device, dummy_slot: int) -> PrefillCaptureBuffer:
        # normal (not inference) tensors: a copy into one bumps its version counter, which the RoPE memo checks
        with torch.inference_mode(False):
            return cls(torch.zeros(num_tokens, dtype=torch.int32, device=device),
                       torch.arange(num_tokens, dtype=torch.int32, device=device),
                       torch.full((num_tokens,), dummy_slot, dtype=torch.int32, device=device))

    def set_batch(self, batch: Batch) -> None:
        batch.input_ids, batch.positions, batch.out_loc = self.input_ids, self.positions, self.out_loc

    def copy_from(self, batch: Batch) -> None:
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        self.out_loc.copy_(batch.out_loc)


def prefill_graph_problem(model: BaseLLMModel, attn_backend: BaseAttnBackend) -> str | None:
    """Why a prefill forward of this model and backend cannot be captured (None: it can)."""
    if not attn_backend.supports_prefill_graph():
        return "the prefill attention backend is not Triton's"
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        return "the model is not a decoder stack under an LM head"
    return None


MIN_TOKENS = 256  # the grid's smallest size
PAD_REQ_TOKENS = 256  # short padding prompts: causal attention costs each its length squared


def prefill_graph_sizes(max_tokens: int, min_tokens: int = MIN_TOKENS) -> List[int]:
    """The token counts captured, largest first: every eighth of ``max_tokens``, then halves down to ``min_tokens``."""
    sizes = {max_tokens} | {max_tokens * k // 8 for k in range(1, 8) if max_tokens * k // 8 >= min_tokens}
    size = max_tokens // 8
    while size // 2 >= min_tokens:
        size //= 2
        sizes.add(size)
    return sorted(sizes, reverse=True)


def padding_reqs(dummy_req: Req, lens: Sequence[int]) -> List[Req]:
    """Dummy prompts of ``lens`` tokens in the padding request's table row."""
    return [Req(input_ids=torch.zeros(n, dtype=torch.int32), table_idx=dummy_req.table_idx, cached_len=0,
                output_len=1, uid=-1 - i, sampling_params=SamplingParams()) for i, n in enumerate(lens)]


def padding_prefill_batch(dummy_req: Req, lens: Sequence[int]) -> Batch:
    """A prefill batch of dummy prompts of ``lens`` tokens (a graph's capture, the start-up warm-up)."""
    batch = Batch(reqs=padding_reqs(dummy_req, lens), phase="prefill")
    batch.padded_reqs = batch.reqs
    return batch


class PrefillGraphRunner:
    def __init__(self, stream: Stream, device: torch.device, model: BaseLLMModel, attn_backend: BaseAttnBackend,
                 sizes: Sequence[int], max_reqs: int, dummy_req: Req):
        self.stream, self.device, self.model, self.attn_backend = stream, device, model, attn_backend
        self.sizes, self.max_reqs, self.dummy_req = sorted(sizes, reverse=True), max_reqs, dummy_req
        self.emulated = not is_cuda(device)
        self._dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        self._pad_reqs: Dict[int, Req] = {}  # dummy prompts by length, made once
        attn_backend.init_prefill_capture(self.sizes[0], min(max_reqs, self.sizes[0]))
        self.buffers: Dict[int, PrefillCaptureBuffer] = {}
        self.hidden: Dict[int, torch.Tensor] = {}  # each graph's output: the stack's final hidden states
        self.graphs: Dict[int, Graph] = {}
        pool, start = None, time.perf_counter()
        for size in self.sizes:  # largest first: the smaller ones reuse its pool's memory
            self.graphs[size] = self._capture(size, pool)
            if pool is None and not self.emulated:
                pool = self.graphs[size].pool()  # type: ignore[attr-defined]
        if not self.emulated:
            logger.info("captured CUDA graphs of the prefill forward at %d token counts (%d to %d) in %.1f s",
                        len(self.sizes), self.sizes[-1], self.sizes[0], time.perf_counter() - start)

    def _capture(self, num_tokens: int, pool: object) -> Graph:
        buffer = self.buffers[num_tokens] = PrefillCaptureBuffer.init(num_tokens, self.device, self._dummy_slot)
        batch = padding_prefill_batch(self.dummy_req, [num_tokens])
        buffer.set_batch(batch)

        def forward() -> None:
            self.hidden[num_tokens] = self.model.model.forward(buffer.input_ids)  # type: ignore[attr-defined]

        with torch.inference_mode(), stream_context(self.stream):
            self.attn_backend.prepare_metadata(batch)
            self.attn_backend.prepare_for_prefill_capture(batch)
            rewire = not self.emulated and rewires_graphs(self.device)
            graph, _ = capture_graph(forward, batch, self.stream, self.emulated, rewire, pool)
            if not self.emulated:
                # the first launch uploads the graph: here, not in the first real step
                graph.replay()
                synchronize(self.device)
        return graph

    def pad_batch(self, batch: Batch) -> None:
        """Pad a prefill batch with dummy prompts up to the next captured size (too many requests: run eagerly)."""
        batch.padded_reqs = list(batch.reqs)
        num_tokens = sum(req.extend_len for req in batch.reqs)
        size = next((s for s in reversed(self.sizes) if s >= num_tokens), None)
        if size is None or size == num_tokens:
            return
        pad = size - num_tokens
        lens = [PAD_REQ_TOKENS] * (pad // PAD_REQ_TOKENS) + ([pad % PAD_REQ_TOKENS] if pad % PAD_REQ_TOKENS else [])
        # the attention's buffers hold min(max_reqs, size) requests (prefill_block_map_capacity)
        if len(batch.reqs) + len(lens) > min(self.max_reqs, size):
            return
        batch.padded_reqs += [self._pad_req(n) for n in lens]

    def _pad_req(self, num_tokens: int) -> Req:
        req = self._pad_reqs.get(num_tokens)
        if req is None:
            req = self._pad_reqs[num_tokens] = padding_reqs(self.dummy_req, [num_tokens])[0]
        return req

    def can_replay(self, batch: Batch) -> bool:
        return batch.is_prefill and batch.input_ids.shape[0] in self.graphs

    def replay(self, batch: Batch) -> torch.Tensor:
        """The batch's logits (its requests' last tokens), inside the engine's forward_batch(batch)."""
        num_tokens = batch.input_ids.shape[0]
        self.buffers[num_tokens].copy_from(batch)
        self.attn_backend.prepare_for_prefill_replay(batch)
        self.graphs[num_tokens].replay()
        return self.model.lm_head.forward(self.hidden[num_tokens])  # type: ignore[attr-defined]

    def destroy(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
