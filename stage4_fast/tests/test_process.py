"""A server process's start-up heap frozen out of the collector's walks (utils/process.py, freeze_startup_heap)."""

from __future__ import annotations

import gc
import weakref

from stage4_fast.utils.process import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected() -> None:
    before = _Node()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # frozen: in no generation the collector walks
        later = _Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
