"""Which tensor-parallel rank this process is. Stage1 runs one rank (size 1); the layers already ask for it so that
their shapes are the TP shapes from the start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size

    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO: DistributedInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    # upstream forbids a second call; several engines may live in one process here, so only a conflict is an error
    global _TP_INFO
    info = DistributedInfo(rank, size)
    if _TP_INFO is not None and _TP_INFO != info:
        raise RuntimeError(f"TP info already set to {_TP_INFO}, cannot change it to {info}")
    _TP_INFO = info


def get_tp_info() -> DistributedInfo:
    # Unlike upstream, an unset value means a single rank, so ops can be built standalone (unit tests).
    return _TP_INFO if _TP_INFO is not None else DistributedInfo(0, 1)


def try_get_tp_info() -> DistributedInfo | None:
    return _TP_INFO
