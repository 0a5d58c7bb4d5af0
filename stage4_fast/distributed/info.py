"""Which tensor-parallel rank this process is: the layers read it when they are built, to take their shard."""

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


def reset_tp_info() -> None:
    """Forget the rank (engine shutdown), so the process may host an engine of another TP layout afterwards."""
    global _TP_INFO
    _TP_INFO = None
