"""The engine: model + KV pool + page table + attention backend + sampler on one device; runs one batch."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..attention import create_attention_backend, validate_attn_backend
from ..core import Batch, Context, Req, SamplingParams, release_global_ctx, set_global_ctx
from ..distributed import set_tp_info
from ..kvcache import create_kvcache_pool
from ..layers import set_rope_device
from ..models import create_model, load_weight
from ..utils import align_ceil, torch_dtype
from ..utils.device import (
    Event,
    create_stream,
    current_stream,
    free_device_memory,
    is_cuda,
    physical_cpu_count,
    record_event,
    stream_context,
)
from ..utils.hf import resolve_model_path
from .config import EngineConfig
from .graph import GraphRunner
from .sample import BatchSamplingArgs, Sampler

logger = logging.getLogger(__name__)

# on CPU a fixed KV budget (host RAM is shared; untouched pages cost nothing), not upstream's share of free memory
CPU_KV_CACHE_BYTES = 1 << 30


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # on the engine device (the name is upstream's)
    next_tokens_cpu: torch.Tensor  # host copy; valid once copy_done_event has completed
    copy_done_event: Event


class Engine:
    def __init__(self, config: EngineConfig):
        tp = config.tp_info
        if tp.size != 1:
            raise NotImplementedError("tensor parallelism arrives in stage4")
        set_tp_info(tp.rank, tp.size)
        self.config = config = self._adjust_config(config)
        model_path = resolve_model_path(config.model_path)
        self.device = torch.device(f"cuda:{tp.rank}") if torch.cuda.is_available() else torch.device("cpu")
        if is_cuda(self.device):
            torch.cuda.set_device(self.device)
        else:
            # the GEMMs are memory-bound: hyper-threads only add contention; each TP rank gets its share of cores
            torch.set_num_threads(max(1, physical_cpu_count() // tp.size))
        torch.manual_seed(42)
        self.stream = create_stream(self.device)
        if isinstance(self.stream, torch.cuda.Stream):
            torch.cuda.set_stream(self.stream)  # as upstream: the engine's private stream is the current one
        self.dtype = config.dtype
        self.ctx = Context(page_size=config.page_size)
        set_global_ctx(self.ctx)

        with stream_context(self.stream):
            model_config = config.model_config
            set_rope_device(self.device)
            with torch.device("meta"), torch_dtype(config.dtype):
                self.model = create_model(model_config)
            self.model.load_state_dict(self._load_weights(model_path))

            self.num_pages = self._num_pages()
            # one extra page at the end: the dummy request's (padding) slots
            self.kv_cache = self.ctx.kv_cache = create_kvcache_pool(
                model_config, self.num_pages + 1, config.page_size, config.dtype, self.device
            )
            self.max_seq_len = min(config.max_seq_len, self.num_pages * config.page_size)
            self.page_table = self.ctx.page_table = torch.zeros(
                config.max_running_req + 1, align_ceil(self.max_seq_len, 32), dtype=torch.int32, device=self.device
            )
            self.attn_backend = self.ctx.attn_backend = create_attention_backend(config.attention_backend, model_config)
            self.sampler = Sampler(self.device, model_config.vocab_size)
            self.dummy_req = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=config.max_running_req,
                                 cached_len=0, output_len=1, uid=-1, sampling_params=SamplingParams())
            self.page_table[self.dummy_req.table_idx].fill_(self.num_pages * config.page_size)
            self.graph_runner = GraphRunner(self.dummy_req)

    @staticmethod
    def _adjust_config(config: EngineConfig) -> EngineConfig:
        validate_attn_backend(config.attention_backend)
        if config.attention_backend == "auto":
            object.__setattr__(config, "attention_backend", "torch")  # the only backend so far
        return config

    def _load_weights(self, model_path: str) -> dict[str, torch.Tensor]:
        if self.config.use_dummy_weight:
            shapes = self.model.state_dict()
            return {k: torch.randn(v.shape, dtype=self.dtype, device=self.device) * 0.02 for k, v in shapes.items()}
        num_kv_heads = self.config.model_config.num_kv_heads
        # each tensor is converted as it streams in: the dict ends up holding the model's only copy
        return {k: v.to(self.dtype) for k, v in load_weight(model_path, self.device, num_kv_heads)}

    def _num_pages(self) -> int:
        config = self.config
        if config.num_page_override is not None:
            return config.num_page_override
        mc = config.model_config
        bytes_per_page = 2 * mc.head_dim * mc.num_kv_heads * config.page_size * self.dtype.itemsize * mc.num_layers
        if is_cuda(self.device):
            budget = int(free_device_memory(self.device) * config.memory_ratio)
        else:
            budget = CPU_KV_CACHE_BYTES
        num_pages = budget // bytes_per_page
        assert num_pages > 1, "not enough memory for the KV cache"
        return num_pages

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        if is_cuda(self.device):
            assert current_stream(self.device) == self.stream, "run forward_batch on the engine stream"
        # Several engines may live in one process (tests); the layers read the global context, so make it ours.
        set_global_ctx(self.ctx)
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            if self.graph_runner.can_use_cuda_graph(batch):
                logits = self.graph_runner.replay(batch)
            else:
                logits = self.model.forward()
            for req in batch.reqs:
                req.complete_one()
            next_tokens_gpu = self.sampler.sample(logits[: batch.size], args).to(torch.int32)
            next_tokens_cpu = next_tokens_gpu.to("cpu", non_blocking=True)
            copy_done_event = record_event(self.device)
        return ForwardOutput(next_tokens_gpu, next_tokens_cpu, copy_done_event)

    def shutdown(self) -> None:
        self.graph_runner.destroy_cuda_graphs()
        release_global_ctx(self.ctx)
