"""Messages to the scheduler (tokenizer worker -> scheduler rank 0 -> the other ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ..core import SamplingParams
from .utils import Message, by_name


@dataclass
class BaseBackendMsg(Message):
    pass


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
    uid: int


BaseBackendMsg.CLASSES = by_name(BatchBackendMsg, ExitMsg, UserMsg, AbortBackendMsg, StatsBackendMsg, SamplingParams)
