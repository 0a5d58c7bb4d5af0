"""A JSON line per overlap loop on rank 0 (``MINISGL_STEP_LOG=FILE``): its start, batch, the host's milliseconds per
part (receive, schedule, launch, process, device wait), the queues. Written when idle, at exit, or every MAX_ROWS."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

MAX_ROWS = 4096


@dataclass
class StepLog:
    path: str  # "": off (the marks are still taken, a few clock reads per loop, so callers need no checks)
    _rows: List[Dict[str, Any]] = field(default_factory=list)
    _marks: List[float] = field(default_factory=list)
    _wait_s: float = 0.0

    def begin(self) -> None:
        self._marks = [time.perf_counter()]
        self._wait_s = 0.0

    def mark(self) -> None:  # the end of one part of the loop (receive, schedule, launch)
        self._marks.append(time.perf_counter())

    def wait_for(self, event: Any) -> None:  # event.synchronize(), timed: the host waiting for the device
        start = time.perf_counter()
        event.synchronize()
        self._wait_s += time.perf_counter() - start

    def end(self, kind: str | None, reqs: int, tokens: int, msgs: int, pending: int, running: int) -> None:
        if not self.path:
            return
        t = [*self._marks, time.perf_counter()]
        receive, schedule, launch, process = (1e3 * (b - a) for a, b in zip(t, t[1:]))
        self._rows.append({"t": t[0], "batch": kind, "reqs": reqs, "tokens": tokens, "msgs": msgs,
                           "receive_ms": receive, "schedule_ms": schedule, "launch_ms": launch, "process_ms": process,
                           "wait_ms": 1e3 * self._wait_s, "pending": pending, "running": running})
        if len(self._rows) >= MAX_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in self._rows)
        self._rows.clear()
