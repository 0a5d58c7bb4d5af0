"""Tensor parallelism for the offline `LLM`: this process is rank 0; ranks 1..tp-1 are scheduler processes of
their own, started here, which take every step's messages from rank 0's broadcast exactly as under the server
(`scheduler/io.py`). They stop when rank 0 broadcasts an `ExitMsg` (`LLM.shutdown`)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from dataclasses import replace
from typing import Any, List

from ..distributed import DistributedInfo, find_free_port

_counter = itertools.count()


def tp_config_fields(tp: int) -> dict:
    """Fields that let this LLM's ranks find each other: a free rendezvous port and its own ipc:// addresses (two
    LLMs of one process must not share them)."""
    if tp == 1:
        return {}
    return dict(_distributed_addr=f"tcp://127.0.0.1:{find_free_port()}",
                _unique_suffix=f".pid={os.getpid()}.llm{next(_counter)}")


def _follower(config: Any) -> None:
    import torch

    from ..scheduler import Scheduler

    with torch.inference_mode():
        scheduler = Scheduler(config)
        try:
            scheduler.run_forever()
        except KeyboardInterrupt:  # ExitMsg from rank 0
            pass
        finally:
            scheduler.shutdown()


def start_followers(config: Any) -> List[mp.process.BaseProcess]:
    """Ranks 1..tp-1 (normal-mode schedulers reading rank 0's broadcast); start them before rank 0's engine: the
    ranks build their engines together (the process group forms during construction)."""
    ctx = mp.get_context("spawn")
    procs = []
    size = config.tp_info.size
    for rank in range(1, size):
        rank_config = replace(config, tp_info=DistributedInfo(rank, size), offline_mode=False)
        proc = ctx.Process(target=_follower, args=(rank_config,), name=f"llm-TP{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def join_followers(procs: List[mp.process.BaseProcess], timeout_s: float = 60.0) -> None:
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
