"""One CUDA graph of the decoder stack's prefill forward at one token count: the size chunked prefill fills a
step to (``max_extend_tokens``).

A prefill step runs eagerly: the host launches every kernel of every layer, 7 per layer and the Python around
them, 11-23 ms for the Qwen3-0.6B shape whatever the step's size and the host, where an 8,192-token step takes an
H200 or H100 ~17.5 ms (``bench/gpu_notes.md``, sections 14 and 38; ``bench/results/h200-prefill-host.md``). A
server's burst of prompts goes in as back-to-back steps of exactly that many tokens, and on a slow host the device
waits for it. Replayed from a graph, such a step costs the host a few copies and one launch.

What lets one graph serve every batch of its token count is the attention: the Triton prefill kernel takes its
(request, query block) work list from the device (``kernel/triton_attention.py: prefill_block_map``) with a grid
of the list's capacity, so nothing of the launch depends on the batch's requests or their lengths. Everything
else in the stack is shaped by the token count alone. A replay copies the batch's token ids, positions, KV slots
(``PrefillCaptureBuffer``) and attention metadata (the backend's ``prepare_for_prefill_replay``) into the
buffers the capture read; the LM head then runs eagerly on the graph's hidden states (its rows, the requests'
last tokens, depend on the batch).

vLLM captures prefill forwards too (piecewise: the attention outside its graphs, the rest compiled); SGLang has
piecewise prefill graphs behind ``--enable-piecewise-cuda-graph``. Here the attention is inside, and only the one
token count is captured: a step of another size (a burst's first and last, a lone short prompt) runs eagerly.
On CPU, ``EmulatedGraph`` stands in for the graph as for decode (``engine/graph.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

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
            return cls(
                input_ids=torch.zeros(num_tokens, dtype=torch.int32, device=device),
                positions=torch.arange(num_tokens, dtype=torch.int32, device=device),
                out_loc=torch.full((num_tokens,), dummy_slot, dtype=torch.int32, device=device),
            )

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


def padding_prefill_batch(dummy_req: Req, lens: Sequence[int]) -> Batch:
    """A prefill batch of dummy prompts of ``lens`` tokens, every one in the padding request's table row: the KV it
    writes goes to the padding slot, which no request reads (the graph's capture, the start-up warm-up)."""
    reqs = [Req(input_ids=torch.zeros(n, dtype=torch.int32), table_idx=dummy_req.table_idx, cached_len=0,
                output_len=1, uid=-1 - i, sampling_params=SamplingParams()) for i, n in enumerate(lens)]
    batch = Batch(reqs=reqs, phase="prefill")
    batch.padded_reqs = batch.reqs
    return batch


class PrefillGraphRunner:
    def __init__(self, stream: Stream, device: torch.device, model: BaseLLMModel, attn_backend: BaseAttnBackend,
                 num_tokens: int, max_reqs: int, dummy_req: Req):
        self.stream = stream
        self.device = device
        self.model = model
        self.attn_backend = attn_backend
        self.num_tokens = num_tokens
        self.emulated = not is_cuda(device)
        dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        self.buffer = PrefillCaptureBuffer.init(num_tokens, device, dummy_slot)
        attn_backend.init_prefill_capture(num_tokens, min(max_reqs, num_tokens))
        self.hidden: torch.Tensor | None = None  # the graph's output: the stack's final hidden states
        self.graph: Graph = self._capture(dummy_req)

    def _capture(self, dummy_req: Req) -> Graph:
        """Capture on a batch of one dummy prompt of ``num_tokens`` tokens in the dummy request's table row: every
        KV slot it writes is the padding slot, which no request reads."""
        batch = padding_prefill_batch(dummy_req, [self.num_tokens])
        self.buffer.set_batch(batch)
        with torch.inference_mode(), stream_context(self.stream):
            self.attn_backend.prepare_metadata(batch)
            self.attn_backend.prepare_for_prefill_capture(batch)
            rewire = not self.emulated and rewires_graphs(self.device)
            graph, _ = capture_graph(self._forward, batch, self.stream, self.emulated, rewire)
            if not self.emulated:
                # a graph's first launch uploads it to the device: done here rather than in the first real step
                # (not measured apart: the ~18 ms a process's first step of many requests took with this replay or
                # without it were kernels' first launches, which the scheduler's start-up warm-up step now pays,
                # bench/results/h100-warm-up-step.md); this one writes the padding slot again
                graph.replay()
                synchronize(self.device)
                logger.info("captured a CUDA graph of the %d-token prefill forward", self.num_tokens)
        return graph

    def _forward(self) -> None:
        self.hidden = self.model.model.forward(self.buffer.input_ids)  # type: ignore[attr-defined]

    def can_replay(self, batch: Batch) -> bool:
        return batch.is_prefill and batch.input_ids.shape[0] == self.num_tokens

    def replay(self, batch: Batch) -> torch.Tensor:
        """The batch's logits (its requests' last tokens), inside the engine's forward_batch(batch)."""
        self.buffer.copy_from(batch)
        self.attn_backend.prepare_for_prefill_replay(batch)
        self.graph.replay()
        assert self.hidden is not None
        return self.model.lm_head.forward(self.hidden)  # type: ignore[attr-defined]

    def destroy(self) -> None:
        self.graph.reset()
