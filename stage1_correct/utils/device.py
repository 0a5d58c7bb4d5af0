"""CUDA streams, events and pinned memory, real on a GPU and no-ops on CPU (upstream assumes CUDA everywhere)."""

from __future__ import annotations

import gc
import os
from contextlib import nullcontext
from typing import ContextManager

import torch


class NullStream:
    """Stands in for torch.cuda.Stream on CPU: work is already ordered."""

    def wait_stream(self, other: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NullEvent:
    """Stands in for torch.cuda.Event on CPU: everything has completed by the time it is recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: object = None) -> None:
        pass


Stream = torch.cuda.Stream | NullStream
Event = torch.cuda.Event | NullEvent


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def free_device_memory(device: torch.device) -> int:
    """Bytes free on a GPU to size a KV pool from (0 on CPU), after returning what engines shut down earlier still
    hold (cached blocks, uncollected cycles), else a second engine's pool gets only what the first left over."""
    if not is_cuda(device):
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def create_stream(device: torch.device) -> Stream:
    return torch.cuda.Stream(device) if is_cuda(device) else NullStream()


def current_stream(device: torch.device) -> Stream | None:
    return torch.cuda.current_stream(device) if is_cuda(device) else None


def stream_context(stream: Stream) -> ContextManager:
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else nullcontext()


def record_event(device: torch.device) -> Event:
    if not is_cuda(device):
        return NullEvent()
    event = torch.cuda.Event()
    event.record()
    return event


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-lock a host tensor that is about to be copied to a GPU (pointless on CPU)."""
    return t.pin_memory() if is_cuda(device) else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that does not block the host on a GPU; the identity on CPU."""
    return pin(t, device).to(device, non_blocking=True) if is_cuda(device) else t.to(device)


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def physical_cpu_count() -> int:
    """Physical cores usable by this process (hyper-threads share one core's FPUs, so they do not speed up GEMMs)."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in usable:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            return len(list(usable)) or 1
    return max(1, len(cores))
