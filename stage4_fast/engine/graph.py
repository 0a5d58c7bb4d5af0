"""CUDA-graph runner for decode batches, with a CPU emulation that keeps the same discipline.

A replay first copies the real batch's inputs (``copy_from``) and attention metadata in. On CPU, ``EmulatedGraph``
re-runs a closure over the *capture* batch, so an input not copied in gives a wrong result there too. Each graph ends
in its logits' greedy argmax (``greedy_tokens``); with PDL kernels it is rewired (``kernel/pdl_graph.py``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Protocol

import torch

from ..core import Batch, Req, get_global_ctx
from ..kernel import greedy_argmax
from ..kernel.pdl_graph import move_edges_to_launch_order
from ..utils.device import Stream, is_cuda, stream_context

if TYPE_CHECKING:
    from ..attention import BaseAttnBackend
    from ..models import BaseLLMModel

logger = logging.getLogger(__name__)


def rewires_graphs(device: torch.device) -> bool:
    """Whether graphs get their edges moved: our kernels use PDL here and torch has ``CUDAGraph(keep_graph=True)``."""
    from ..kernel.pdl import pdl_launch  # imports triton: never at module import (tests pick its interpreter first)

    if not pdl_launch(device)[0]:
        return False
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return False
    return True

EMULATION_MAX_BS = 16  # what the tests ask for on a CPU (where graphs are off unless asked for: they save nothing)


class Graph(Protocol):
    def replay(self) -> None: ...

    def reset(self) -> None: ...


class EmulatedGraph:  # a recorded closure standing in for a CUDA graph on CPU
    def __init__(self, fn: Callable[[], None]):
        self._fn: Callable[[], None] | None = fn

    def replay(self) -> None:
        assert self._fn is not None, "graph was destroyed"
        self._fn()

    def reset(self) -> None:
        self._fn = None


def capture_graph(run: Callable[[], None], batch: Batch, stream: Stream, emulated: bool, rewire: bool,
                  pool: object = None) -> tuple[Graph, int]:
    """Run ``run`` once on ``batch``, then capture it: a CUDA graph in ``pool`` (and the edges moved if ``rewire``), or
    an ``EmulatedGraph`` replaying on the capture batch, as a real graph only sees what it captured."""
    ctx = get_global_ctx()
    with ctx.forward_batch(batch):
        run()
    if emulated:
        def replay() -> None:
            current = get_global_ctx()  # (the engine's: forward_batch made it the global one)
            replayed, current._batch = current._batch, batch
            try:
                run()
            finally:
                current._batch = replayed

        return EmulatedGraph(replay), 0
    graph = torch.cuda.CUDAGraph(keep_graph=True) if rewire else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream), ctx.forward_batch(batch):
        run()
    moved = 0
    if rewire:
        moved = move_edges_to_launch_order(graph)
        graph.instantiate()
    return graph, moved


@dataclass
class GraphCaptureBuffer:
    input_ids: torch.Tensor  # [max_bs] int32
    out_loc: torch.Tensor  # [max_bs] int32
    positions: torch.Tensor  # [max_bs] int32
    logits: torch.Tensor  # [max_bs, vocab] in the model's dtype, as eager returns (fp32: a conversion per replay more)

    @classmethod
    def init(cls, bs: int, vocab_size: int, device: torch.device, dummy_slot: int = 0,
             logits_dtype: torch.dtype = torch.float32) -> GraphCaptureBuffer:
        # out_loc at the dummy slot: capture writes KV where nothing lives; not inference tensors: memos check versions
        with torch.inference_mode(False):
            return cls(input_ids=torch.zeros(bs, dtype=torch.int32, device=device),
                       out_loc=torch.full((bs,), dummy_slot, dtype=torch.int32, device=device),
                       positions=torch.zeros(bs, dtype=torch.int32, device=device),
                       logits=torch.empty(bs, vocab_size, dtype=logits_dtype, device=device))

    def set_batch(self, batch: Batch) -> None:
        """Make the capture batch's inputs views of the buffers."""
        bs = batch.padded_size
        batch.input_ids = self.input_ids[:bs]
        batch.out_loc = self.out_loc[:bs]
        batch.positions = self.positions[:bs]
        batch.logits_out = self.logits[:bs]

    def copy_from(self, batch: Batch) -> None:
        bs = batch.padded_size
        self.input_ids[:bs].copy_(batch.input_ids)
        self.out_loc[:bs].copy_(batch.out_loc)
        self.positions[:bs].copy_(batch.positions)


def default_graph_bs_list(device: torch.device, free_memory: int, cuda_graph_bs: List[int] | None,
                          cuda_graph_max_bs: int | None) -> List[int]:
    """Explicit list if given; else [1, 2, 4] + multiples of 8 up to the max: 256 on a GPU with over 60 GiB free,
    160 on a smaller one, none on a CPU (an explicit max turns the emulation on). A max below 1 disables graphs."""
    if cuda_graph_bs is not None:
        return sorted(set(cuda_graph_bs))
    if cuda_graph_max_bs is None:
        cuda_graph_max_bs = (256 if free_memory > 60 * (1 << 30) else 160) if is_cuda(device) else 0
    if cuda_graph_max_bs < 1:
        return []
    sizes = [bs for bs in (1, 2, 4) if bs <= cuda_graph_max_bs]
    return sizes + list(range(8, cuda_graph_max_bs + 1, 8))


class GraphRunner:
    def __init__(self, stream: Stream, device: torch.device, model: BaseLLMModel, attn_backend: BaseAttnBackend,
                 cuda_graph_bs: List[int] | None, cuda_graph_max_bs: int | None, free_memory: int, max_seq_len: int,
                 vocab_size: int, dummy_req: Req, logits_dtype: torch.dtype = torch.float32):
        self.stream, self.device, self.model, self.attn_backend = stream, device, model, attn_backend
        self.dummy_req = dummy_req
        self.graph_bs_list = default_graph_bs_list(device, free_memory, cuda_graph_bs, cuda_graph_max_bs)
        self.max_graph_bs = max(self.graph_bs_list, default=0)
        self.graph_map: Dict[int, Graph] = {}
        self.greedy_of: Dict[int, torch.Tensor] = {}  # per captured size: its replay's argmax of the logits
        self.emulated = not is_cuda(device)
        if self.max_graph_bs == 0:
            return
        dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        self.buffer = GraphCaptureBuffer.init(self.max_graph_bs, vocab_size, device, dummy_slot, logits_dtype)
        self._capture_graphs(max_seq_len)

    def _capture_graphs(self, max_seq_len: int) -> None:
        self.attn_backend.init_capture_graph(max_seq_len, self.graph_bs_list)
        logger.info("capturing %s graphs for batch sizes %s", "emulated" if self.emulated else "CUDA",
                    self.graph_bs_list)
        rewire = not self.emulated and rewires_graphs(self.device)
        pool, launch_order_edges = None, 0
        with torch.inference_mode(), stream_context(self.stream):
            for bs in sorted(self.graph_bs_list, reverse=True):  # largest first: later ones reuse its memory
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                batch.padded_reqs = batch.reqs
                self.buffer.set_batch(batch)
                self.attn_backend.prepare_for_capture(batch)
                graph, moved = capture_graph(functools.partial(self._forward_into_buffer, bs), batch, self.stream,
                                             self.emulated, rewire, pool)
                launch_order_edges += moved
                if isinstance(graph, torch.cuda.CUDAGraph):
                    pool = graph.pool()
                self.graph_map[bs] = graph
        if rewire:
            logger.info("%d graph edges out of kernels launched without PDL leave at launch order", launch_order_edges)

    def _forward_into_buffer(self, bs: int) -> None:
        """The forward (its LM head writes into ``Batch.logits_out``), then the logits' greedy argmax."""
        logits = self.model.forward()
        assert logits.data_ptr() == self.buffer.logits.data_ptr(), "the LM head must write into Batch.logits_out"
        self.greedy_of[bs] = greedy_argmax(logits)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return batch.is_decode and 0 < batch.size <= self.max_graph_bs

    def pad_batch(self, batch: Batch) -> None:
        """Pad a graph-eligible decode batch with the dummy request up to the next captured size."""
        if not self.can_use_cuda_graph(batch):
            batch.padded_reqs = list(batch.reqs)
            return
        padded = next(bs for bs in self.graph_bs_list if bs >= batch.size)
        batch.padded_reqs = list(batch.reqs) + [self.dummy_req] * (padded - batch.size)

    def replay(self, batch: Batch) -> torch.Tensor:
        assert batch.padded_size in self.graph_map, "pad_batch first"
        self.buffer.copy_from(batch)
        self.attn_backend.prepare_for_replay(batch)
        self.graph_map[batch.padded_size].replay()
        return self.buffer.logits[: batch.size]

    def greedy_tokens(self, batch: Batch) -> torch.Tensor:
        """int32 [batch.size] argmax of the last replay's logits (a view the next replay overwrites)."""
        return self.greedy_of[batch.padded_size][: batch.size]

    def destroy_cuda_graphs(self) -> None:
        for graph in self.graph_map.values():
            graph.reset()
        self.graph_map.clear()
