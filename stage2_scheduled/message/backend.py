"""Messages to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ..core import SamplingParams


@dataclass
class BaseBackendMsg:
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
