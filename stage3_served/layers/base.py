"""Ops without nn.Module: weights are plain tensor attributes, found by walking __dict__. A model built on the
meta device has shapes only; load_state_dict replaces each meta tensor, so the weights exist exactly once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Generic, List, TypeVar

import torch

_T = TypeVar("_T", bound="BaseOP")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class BaseOP(ABC):
    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def state_dict(self, *, prefix: str = "", result: Dict[str, torch.Tensor] | None = None) -> Dict[str, torch.Tensor]:
        result = {} if result is None else result
        for name, value in self.__dict__.items():
            if name.startswith("_"):  # private: caches, references to ops owned elsewhere
                continue
            if isinstance(value, torch.Tensor):
                result[_join(prefix, name)] = value
            elif isinstance(value, BaseOP):
                value.state_dict(prefix=_join(prefix, name), result=result)
        return result

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], *, prefix: str = "",
                        _internal: bool = False) -> None:
        """Consumes (pops) the keys this op owns; at the top level anything left over is an error."""
        for name, value in list(self.__dict__.items()):
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                key = _join(prefix, name)
                if key not in state_dict:
                    raise KeyError(f"missing weight {key!r}")
                loaded = state_dict.pop(key)
                assert loaded.shape == value.shape, f"{key}: shape {tuple(loaded.shape)} != {tuple(value.shape)}"
                assert loaded.dtype == value.dtype, f"{key}: dtype {loaded.dtype} != {value.dtype}"
                setattr(self, name, loaded)
            elif isinstance(value, BaseOP):
                value.load_state_dict(state_dict, prefix=_join(prefix, name), _internal=True)
        if not _internal and state_dict:
            raise RuntimeError(f"unexpected weights: {sorted(state_dict)[:8]}")


class StateLessOP(BaseOP):
    def state_dict(self, *, prefix: str = "", result: Dict[str, torch.Tensor] | None = None) -> Dict[str, torch.Tensor]:
        return {} if result is None else result

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], *, prefix: str = "",
                        _internal: bool = False) -> None:
        if not _internal and state_dict:
            raise RuntimeError(f"unexpected weights: {sorted(state_dict)[:8]}")


class OPList(BaseOP, Generic[_T]):
    def __init__(self, ops: List[_T]) -> None:
        self.op_list = ops

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("iterate over op_list instead")

    def state_dict(self, *, prefix: str = "", result: Dict[str, torch.Tensor] | None = None) -> Dict[str, torch.Tensor]:
        result = {} if result is None else result
        for i, op in enumerate(self.op_list):
            op.state_dict(prefix=_join(prefix, str(i)), result=result)
        return result

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], *, prefix: str = "",
                        _internal: bool = False) -> None:
        for i, op in enumerate(self.op_list):
            op.load_state_dict(state_dict, prefix=_join(prefix, str(i)), _internal=True)
        if not _internal and state_dict:
            raise RuntimeError(f"unexpected weights: {sorted(state_dict)[:8]}")
