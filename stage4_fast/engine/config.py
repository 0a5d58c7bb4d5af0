from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List

import torch
from transformers import PretrainedConfig

from ..distributed import DistributedInfo
from ..models import ModelConfig
from ..utils.hf import cached_load_hf_config


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    # upstream requires tp_info and dtype; single rank and fp32 are the natural defaults on CPU
    tp_info: DistributedInfo = field(default_factory=lambda: DistributedInfo(0, 1))
    dtype: torch.dtype = torch.float32
    max_running_req: int = 256
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    cuda_graph_bs: List[int] | None = None
    cuda_graph_max_bs: int | None = None
    prefill_cuda_graph: bool | None = None  # None: on a GPU with graphs on; True: also emulated on a CPU
    page_size: int = 1
    kv_cache_dtype: str = "auto"  # what the KV pool stores: "auto" (the model's dtype) or kvcache/dtype.py's names
    calculate_kv_scales: bool = False  # fp8 KV without checkpoint scales: per-layer scales from a calibration prefill
    memory_ratio: float = 0.9
    distributed_timeout: float = 60.0
    use_dummy_weight: bool = False
    max_seq_len_override: int | None = None
    num_page_override: int | None = None
    _distributed_addr: str = "tcp://127.0.0.1:2333"  # TP rendezvous; upstream hard-codes it, starters pass a free port
    nnodes: int = 1  # machines the TP ranks span (SGLang's --nnodes), tp / nnodes ranks each, numbered in order

    @functools.cached_property
    def hf_config(self) -> PretrainedConfig:
        return cached_load_hf_config(self.model_path)

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return self.model_config.rotary_config.max_position

    @property
    def distributed_addr(self) -> str:
        return self._distributed_addr

    @property
    def ranks_per_node(self) -> int:
        return self.tp_info.size // self.nnodes

    @property
    def local_rank(self) -> int:
        """The rank's index on its own machine: which of that machine's GPUs it takes."""
        return self.tp_info.rank % self.ranks_per_node
