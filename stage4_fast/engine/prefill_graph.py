"""CUDA graphs of the decoder stack's prefill forward at a grid of token counts up to the size chunked prefill fills
a step to (``max_extend_tokens``); a step of another count is padded up to the next one.

Eagerly, the host launches every kernel of every layer and runs the Python around them, which for a small model
takes about as long as the device needs for a full step: a burst of prompts, going in as back-to-back full steps,
would leave the device waiting on the host. Replayed from a graph, a step costs the host a few copies and a launch.

One graph serves every batch of its token count because of the attention: the Triton prefill kernel takes its
(request, query block) work list from the device (``kernel/triton_prefill.py: prefill_block_map``) with a grid of
the list's capacity, and everything else in the stack is shaped by the token count alone. A replay copies the
batch's token ids, positions, KV slots (``PrefillCaptureBuffer``) and attention metadata into the captured buffers;
the LM head then runs eagerly on the graph's hidden states (its rows, the requests' last tokens, depend on the batch).

Other token counts (a burst's first and last steps, a lone prompt) are padded, as decode batches are, up to the next
size of the grid (``prefill_graph_sizes``): every eighth of the step size, then halves down to ``MIN_TOKENS``. The
padding is dummy prompts of at most ``PAD_REQ_TOKENS`` tokens in the padding request's table row: their KV goes to
the padding slot, which no request reads, and the LM head takes only the batch's own rows. The graphs share one
memory pool, captured from the largest down, as vLLM's are (vLLM and SGLang capture prefill piecewise, the attention
outside; here it is inside). On CPU, ``EmulatedGraph`` stands in for the graphs (``engine/graph.py``).
"""

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


# the grid's smallest size: a step below it pads up to it (a small fraction of a full step's device time)
MIN_TOKENS = 256
# the padding's prompts are at most this long: causal attention over each costs its length squared, so one dummy
# prompt of the whole padding (up to an eighth of a step) would cost more than several short ones
PAD_REQ_TOKENS = 256


def prefill_graph_sizes(max_tokens: int, min_tokens: int = MIN_TOKENS) -> List[int]:
    """The token counts captured, largest first: every eighth of ``max_tokens`` (a padded step carries at most an
    eighth of a full one's tokens more), then halves of the smallest eighth down to ``min_tokens``; ``max_tokens`` alone
    when it is no larger than ``min_tokens``."""
    sizes = {max_tokens}
    for k in range(1, 8):
        size = max_tokens * k // 8
        if size >= min_tokens:
            sizes.add(size)
    size = max_tokens // 8
    while size // 2 >= min_tokens:
        size //= 2
        sizes.add(size)
    return sorted(sizes, reverse=True)


def padding_reqs(dummy_req: Req, lens: Sequence[int]) -> List[Req]:
    """Dummy prompts of ``lens`` tokens, every one in the padding request's table row: the KV they write goes to
    the padding slot, which no request reads."""
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
        self.stream = stream
        self.device = device
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = sorted(sizes, reverse=True)
        self.max_reqs = max_reqs
        self.dummy_req = dummy_req
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
        """Capture on a batch of one dummy prompt of ``num_tokens`` tokens in the dummy request's table row: every
        KV slot it writes is the padding slot, which no request reads."""
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
                # a graph's first launch uploads it to the device: here rather than in the first real step (it writes
                # the padding slot again)
                graph.replay()
                synchronize(self.device)
        return graph

    def pad_batch(self, batch: Batch) -> None:
        """Pad a prefill batch with dummy prompts up to the next captured size, after its own requests; a batch
        the capture's buffers cannot take with them (too many requests) stays as it is and runs eagerly."""
        batch.padded_reqs = list(batch.reqs)
        num_tokens = sum(req.extend_len for req in batch.reqs)
        size = next((s for s in reversed(self.sizes) if s >= num_tokens), None)
        if size is None or size == num_tokens:
            return
        pad = size - num_tokens
        lens = [PAD_REQ_TOKENS] * (pad // PAD_REQ_TOKENS) + ([pad % PAD_REQ_TOKENS] if pad % PAD_REQ_TOKENS else [])
        # the attention's buffers hold min(max_reqs, size) requests, and its work list as many blocks more than
        # the tokens fill (kernel/triton_prefill.py: prefill_block_map_capacity)
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
