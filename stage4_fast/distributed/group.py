"""Process-group start-up for the TP ranks of one engine."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .info import DistributedInfo


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (upstream hard-codes 2333, so two engines on one host collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(tp_info: DistributedInfo, addr: str, device: torch.device,
                       timeout_s: float = 60.0) -> dist.ProcessGroup | None:
    """Join the TP group at ``tcp://host:port`` (NCCL, gloo on CPU); returns the gloo ``tp_cpu_group``, None alone."""
    if tp_info.size == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=addr, rank=tp_info.rank, world_size=tp_info.size,
                            timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None)
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
