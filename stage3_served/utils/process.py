"""What every worker process of the engine does first (not upstream)."""

from __future__ import annotations

import threading

from setproctitle import setproctitle
from tqdm import tqdm


def setup_worker_process(role: str) -> None:
    """Name the process `minisgl::<role>` in `ps` / `top` (as SGLang's `sglang::scheduler`), and give tqdm a thread
    lock: its default is a multiprocessing RLock, a named semaphore registered with multiprocessing's resource
    tracker that a killed worker never unregisters ("There appear to be 1 leaked semaphore objects to clean up at
    shutdown"); a worker's progress bars share nothing with other processes."""
    setproctitle(f"minisgl::{role}")
    tqdm.set_lock(threading.RLock())
