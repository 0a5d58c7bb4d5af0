"""ZMQ queues between the server's processes: PUSH/PULL pipes and a PUB/SUB broadcast, sync and asyncio.

A queue owns its context and one socket (``create=True`` binds, else connects); a message is ``msgpack(encoder(obj))``.
High-water marks are unbounded: ZMQ would otherwise drop (PUB) or block (PUSH) past 1000 queued messages.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from typing import Any, Callable, Generic, Tuple, TypeVar

import msgpack
import zmq
import zmq.asyncio

T = TypeVar("T")

# how long close() keeps trying to deliver queued messages (the default, forever, can hang shutdown)
_LINGER_MS = 1000


def _pack(encoder: Callable[[Any], Any], obj: Any) -> bytes:
    return msgpack.packb(encoder(obj), use_bin_type=True)


def _unpack(decoder: Callable[[Any], T], raw: bytes) -> T:
    return decoder(msgpack.unpackb(raw, raw=False))


def _attach(socket: zmq.Socket, addr: str, create: bool) -> str | None:
    """Bind (create) or connect; returns the file an ipc:// bind created, which libzmq leaves behind on close."""
    if not create:
        socket.connect(addr)
        return None
    socket.bind(addr)
    return addr.removeprefix("ipc://") if addr.startswith("ipc://") else None


def _open(context: zmq.Context, kind: int, addr: str, create: bool) -> Tuple[zmq.Socket, str | None]:
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, _LINGER_MS)
    return socket, _attach(socket, addr, create)


class _Queue:
    context: zmq.Context
    socket: zmq.Socket
    bound_file: str | None = None  # the ipc:// socket file this queue's bind created

    def stop(self) -> None:
        self.socket.close()
        self.context.term()
        if self.bound_file is not None:  # the binder owns the file: no /tmp/minisgl_* left after a clean exit
            with suppress(FileNotFoundError):
                os.unlink(self.bound_file)


class _SyncReceiver(_Queue, Generic[T]):
    """The receiving end shared by PULL and SUB: messages are decoded with the queue's `decoder`."""

    decoder: Callable[[Any], T]

    def get(self) -> T:
        return self.decode(self.get_raw())

    def get_raw(self) -> bytes:
        return self.socket.recv()

    def decode(self, raw: bytes) -> T:
        return _unpack(self.decoder, raw)

    def empty(self) -> bool:
        return self.socket.poll(timeout=0) == 0


class ZmqPushQueue(_Queue, Generic[T]):
    def __init__(self, addr: str, create: bool, encoder: Callable[[T], Any]):
        self.context = zmq.Context()
        self.socket, self.bound_file = _open(self.context, zmq.PUSH, addr, create)
        self.encoder = encoder

    def put(self, obj: T) -> None:
        self.socket.send(_pack(self.encoder, obj), copy=False)


class ZmqAsyncPushQueue(_Queue, Generic[T]):
    def __init__(self, addr: str, create: bool, encoder: Callable[[T], Any]):
        self.context = zmq.asyncio.Context()
        self.socket, self.bound_file = _open(self.context, zmq.PUSH, addr, create)
        self.encoder = encoder

    async def put(self, obj: T) -> None:
        await self.socket.send(_pack(self.encoder, obj), copy=False)

    def put_nowait(self, obj: T) -> None:
        """Queue without awaiting (``finally`` blocks of cancelled tasks); an unbounded queue never has to wait."""
        self.socket.send(_pack(self.encoder, obj), copy=False, flags=zmq.NOBLOCK)


class ZmqPullQueue(_SyncReceiver[T]):
    def __init__(self, addr: str, create: bool, decoder: Callable[[Any], T]):
        self.context = zmq.Context()
        self.socket, self.bound_file = _open(self.context, zmq.PULL, addr, create)
        self.decoder = decoder


class ZmqAsyncPullQueue(_Queue, Generic[T]):
    def __init__(self, addr: str, create: bool, decoder: Callable[[Any], T]):
        self.context = zmq.asyncio.Context()
        self.socket, self.bound_file = _open(self.context, zmq.PULL, addr, create)
        self.decoder = decoder

    async def get(self) -> T:
        return _unpack(self.decoder, await self.socket.recv())


class ZmqPubQueue(_Queue, Generic[T]):
    """Broadcast to every subscriber. Fixes upstream's slow-joiner race (PUB drops what it sends before a
    subscription arrives; upstream's barrier proves only that SUB sockets exist): as an XPUB socket it sees each
    subscription, so ``wait_for_subscribers(n)`` blocks until n are in and nothing published after is lost."""

    def __init__(self, addr: str, create: bool, encoder: Callable[[T], Any]):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, also repeats of the same topic
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self.bound_file = _attach(self.socket, addr, create)
        self.encoder = encoder
        self.num_subscribers = 0

    def wait_for_subscribers(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_subscribers < n:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.socket.poll(timeout=left_ms):
                raise TimeoutError(f"only {self.num_subscribers} of {n} subscribers joined within {timeout_s} s")
            if self.socket.recv()[:1] == b"\x01":  # b"\x01" + topic = subscribe, b"\x00" + topic = unsubscribe
                self.num_subscribers += 1

    def put_raw(self, raw: bytes) -> None:
        self.socket.send(raw, copy=False)

    def put(self, obj: T) -> None:
        self.put_raw(_pack(self.encoder, obj))


class ZmqSubQueue(_SyncReceiver[T]):
    def __init__(self, addr: str, create: bool, decoder: Callable[[Any], T]):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.bound_file = _attach(self.socket, addr, create)
        self.decoder = decoder

