"""What every worker process of the engine does first (not upstream)."""

from __future__ import annotations

import gc
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


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now into the permanent generation (`gc.freeze`), where the
    collector no longer walks it. A server process keeps its modules, model and app until it exits, and its
    requests allocate steadily, so every oldest-generation collection would walk that whole start-up heap, a pause
    of every request the process serves. What it allocates from here on is collected as before. vLLM freezes its
    workers' heap after warm-up (`freeze_gc_heap`) and SGLang has a `freeze_gc` call for the same. Only for a
    process the engine owns: an object frozen here is never collected, even if it later becomes garbage."""
    gc.collect()
    gc.freeze()
