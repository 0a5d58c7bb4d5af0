"""Tensor parallelism for the offline `LLM`: ranks 1..tp-1 are spawned scheduler processes reading rank 0's broadcast
(`scheduler/io.py`); each reports back once running, so a script creating the `LLM` outside `__main__` fails at once."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import time
from dataclasses import replace
from typing import Any, List

from ..distributed import DistributedInfo, find_free_port

_counter = itertools.count()


def tp_config_fields(tp: int) -> dict:
    """A free rendezvous port and ipc:// addresses of this LLM's own (two LLMs of a process must not share them)."""
    if tp == 1:
        return {}
    return dict(_distributed_addr=f"tcp://127.0.0.1:{find_free_port()}",
                _unique_suffix=f".pid={os.getpid()}.llm{next(_counter)}")


class RankDied(RuntimeError):
    pass


def _follower(config: Any, started: mp.connection.Connection) -> None:
    started.send(os.getpid())  # we got past the re-import of the main script
    started.close()
    import torch

    from ..scheduler import Scheduler
    from ..utils.process import setup_worker_process

    setup_worker_process(f"scheduler_{config.tp_info.rank}")

    with torch.inference_mode():
        scheduler = Scheduler(config)
        try:
            scheduler.run_forever()
        except KeyboardInterrupt:  # ExitMsg from rank 0
            pass
        finally:
            scheduler.shutdown()


def start_followers(config: Any) -> List[mp.process.BaseProcess]:
    """Ranks 1..tp-1, started before rank 0's engine (the process group forms while the engines are built)."""
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    size = config.tp_info.size
    for rank in range(1, size):
        rank_config = replace(config, tp_info=DistributedInfo(rank, size), offline_mode=False)
        started_recv, started_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_follower, args=(rank_config, started_send), name=f"llm-TP{rank}", daemon=True)
        proc.start()
        started_send.close()  # the child holds its own copy; ours would keep the pipe open after the child died
        procs.append(proc)
        pipes.append(started_recv)
    try:
        _wait_started(procs, pipes, config.distributed_timeout)
    except RankDied:
        join_followers(procs, timeout_s=1.0)
        raise
    return procs


def _wait_started(procs: List[mp.process.BaseProcess], pipes: List[mp.connection.Connection], timeout_s: float) -> None:
    """Wait until every rank runs; a rank that exits first fails the start now, not at the process group's timeout."""
    deadline = time.monotonic() + timeout_s
    for rank, (proc, pipe) in enumerate(zip(procs, pipes), start=1):
        with pipe:
            if not mp.connection.wait([pipe], timeout=max(0.0, deadline - time.monotonic())):
                return
            try:
                pipe.recv()
            except EOFError:
                proc.join(1.0)
                raise RankDied(f"TP rank {rank} exited with code {proc.exitcode} before it started (its error is "
                               "printed above). The ranks are spawned processes that re-import the main script: a "
                               'script must create LLM(..., tp=...) under `if __name__ == "__main__":`.') from None


def join_followers(procs: List[mp.process.BaseProcess], timeout_s: float = 60.0) -> None:
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
