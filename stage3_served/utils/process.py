"""What every worker process of the engine does first (not upstream)."""

from __future__ import annotations

import threading

from setproctitle import setproctitle
from tqdm import tqdm


def setup_worker_process(role: str) -> None:
    """Name the process `minisgl::<role>` in `ps`, and give tqdm a thread lock: its default multiprocessing RLock is
    a named semaphore that a killed worker leaks ("leaked semaphore objects" at shutdown)."""
    setproctitle(f"minisgl::{role}")
    tqdm.set_lock(threading.RLock())
