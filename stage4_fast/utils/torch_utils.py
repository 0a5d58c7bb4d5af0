from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

_NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}


@contextmanager
def torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily change the default dtype (ops create their weights with it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A host tensor of Python ints, built through numpy (torch.tensor(list) converts element by element)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype]))
