"""Messages to the scheduler (tokenizer worker -> scheduler rank 0 -> the other ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from ..core import SamplingParams
from .utils import deserialize_type, serialize_type


@dataclass
class BaseBackendMsg:
    def encoder(self) -> Dict[str, Any]:
        return serialize_type(self)

    @staticmethod
    def decoder(data: Dict[str, Any]) -> BaseBackendMsg:
        return deserialize_type(_CLS_MAP, data)


@dataclass
class BatchBackendMsg(BaseBackendMsg):
    data: List[BaseBackendMsg]


@dataclass
class ExitMsg(BaseBackendMsg):
    pass


@dataclass
class UserMsg(BaseBackendMsg):
    uid: int
    input_ids: torch.Tensor  # host, 1-D int32
    sampling_params: SamplingParams


@dataclass
class AbortBackendMsg(BaseBackendMsg):
    uid: int


@dataclass
class StatsBackendMsg(BaseBackendMsg):
    """Asks the scheduler for its KV pool / cache / queue figures (not upstream: read by /v1/stats and tests)."""

    uid: int


_CLS_MAP = {c.__name__: c for c in (BatchBackendMsg, ExitMsg, UserMsg, AbortBackendMsg, StatsBackendMsg,
                                    SamplingParams)}
