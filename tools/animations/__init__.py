"""Animations of real runs: each records what a stage did (``record_*``: events), turns the events into frames
(``frames``) and draws the frames into a GIF (``render``)."""

from __future__ import annotations

from typing import Callable, Dict

from .record_engine import (
    Recording,
    record_continuous_batching,
    record_cuda_graph,
    record_overlap,
    record_request_life,
)
from .record_radix import record_radix
from .record_tp import record_tp

RECORDERS: Dict[str, Callable[[str], Recording]] = {
    "request-life": record_request_life,
    "continuous-batching": record_continuous_batching,
    "radix-cache": record_radix,
    "overlap": record_overlap,
    "tp": record_tp,
    "cuda-graph": record_cuda_graph,
}
NAMES = list(RECORDERS)

__all__ = ["NAMES", "RECORDERS", "Recording"]
