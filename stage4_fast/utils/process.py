"""What every worker process of the engine does first (not upstream)."""

from __future__ import annotations

import gc
import threading

from setproctitle import setproctitle
from tqdm import tqdm


def setup_worker_process(role: str) -> None:
    """Name the process `minisgl::<role>`; tqdm gets a thread lock (its multiprocessing one leaks when killed)."""
    setproctitle(f"minisgl::{role}")
    tqdm.set_lock(threading.RLock())


def freeze_startup_heap() -> None:
    """`gc.freeze` (as vLLM, SGLang): full collections skip the start-up heap, whose objects are then never freed."""
    gc.collect()
    gc.freeze()
