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
    page_size: int = 1
    memory_ratio: float = 0.9
    distributed_timeout: float = 60.0
    use_dummy_weight: bool = False
    max_seq_len_override: int | None = None
    num_page_override: int | None = None

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
