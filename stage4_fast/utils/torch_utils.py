from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily change the default dtype (ops create their weights with it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
