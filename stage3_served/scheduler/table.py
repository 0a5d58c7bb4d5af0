from __future__ import annotations

from collections import deque

import torch


class TableManager:
    """Request slots: rows of the page table, and of the token pool that holds each slot's token ids."""

    def __init__(self, max_running_reqs: int, page_table: torch.Tensor) -> None:
        # FIFO reuse (upstream: LIFO): extra distance beyond releasing a row after its last batch (upstream bug 3)
        self._free_slots = deque(range(max_running_reqs))
        self.page_table = page_table
        # token ids per (slot, position). Zeros keep the dummy row's input valid.
        self.token_pool = torch.zeros_like(page_table, dtype=torch.int32)

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        return self._free_slots.popleft()

    def free(self, slot: int) -> None:
        self._free_slots.append(slot)
