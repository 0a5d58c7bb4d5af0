"""ZMQ queues between the server's processes: PUSH/PULL pipes and a PUB/SUB broadcast, sync and asyncio.

A queue owns its context and one socket (``create=True`` binds, else connects); a message is ``msgpack(encoder(obj))``.
High-water marks are unbounded: ZMQ would otherwise drop (PUB) or block (PUSH) past 1000 queued messages."""

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


class _Queue:
    """One socket of ``KIND`` in its own context; ``codec`` is the encoder (sending ends) or decoder (receiving)."""

    CONTEXT: Callable[[], zmq.Context] = zmq.Context
    KIND: int
    OPTIONS: Tuple[Tuple[int, Any], ...] = ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, _LINGER_MS))
    bound_file: str | None = None  # the ipc:// socket file this queue's bind created

    def __init__(self, addr: str, create: bool, codec: Callable[[Any], Any]) -> None:
        self.context, self.codec = self.CONTEXT(), codec
        self.socket = self.context.socket(self.KIND)
        for option, value in self.OPTIONS:
            self.socket.setsockopt(option, value)
        if not create:
            self.socket.connect(addr)
            return
        self.socket.bind(addr)
        if addr.startswith("ipc://"):  # libzmq leaves the file behind on close
            self.bound_file = addr.removeprefix("ipc://")

    def stop(self) -> None:
        self.socket.close()
        self.context.term()
        if self.bound_file is not None:  # the binder owns the file: no /tmp/minisgl_* left after a clean exit
            with suppress(FileNotFoundError):
                os.unlink(self.bound_file)


class _SyncReceiver(_Queue, Generic[T]):
    """The receiving end shared by PULL and SUB."""

    def get(self) -> T:
        return self.decode(self.get_raw())

    def get_raw(self) -> bytes:
        return self.socket.recv()

    def decode(self, raw: bytes) -> T:
        return _unpack(self.codec, raw)

    def empty(self) -> bool:
        return self.socket.poll(timeout=0) == 0


class ZmqPushQueue(_Queue, Generic[T]):
    KIND = zmq.PUSH

    def put(self, obj: T) -> None:
        self.socket.send(_pack(self.codec, obj), copy=False)


class ZmqAsyncPushQueue(_Queue, Generic[T]):
    CONTEXT, KIND = zmq.asyncio.Context, zmq.PUSH

    async def put(self, obj: T) -> None:
        await self.socket.send(_pack(self.codec, obj), copy=False)

    def put_nowait(self, obj: T) -> None:
        """Queue without awaiting (``finally`` blocks of cancelled tasks); an unbounded queue never has to wait."""
        self.socket.send(_pack(self.codec, obj), copy=False, flags=zmq.NOBLOCK)


class ZmqPullQueue(_SyncReceiver[T]):
    KIND = zmq.PULL


class ZmqAsyncPullQueue(_Queue, Generic[T]):
    CONTEXT, KIND = zmq.asyncio.Context, zmq.PULL

    async def get(self) -> T:
        return _unpack(self.codec, await self.socket.recv())


class ZmqPubQueue(_Queue, Generic[T]):
    """Broadcast to every subscriber. Fixes upstream's slow-joiner race (PUB drops what it sends before a
    subscription arrives; upstream's barrier proves only that SUB sockets exist): as an XPUB socket it sees each
    subscription, so ``wait_for_subscribers(n)`` blocks until n are in and nothing published after is lost."""

    # XPUB_VERBOSE: report every subscription, also repeats of the same topic
    KIND, OPTIONS = zmq.XPUB, ((zmq.XPUB_VERBOSE, 1), (zmq.SNDHWM, 0), (zmq.LINGER, _LINGER_MS))
    num_subscribers = 0

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
        self.put_raw(_pack(self.codec, obj))


class ZmqSubQueue(_SyncReceiver[T]):
    KIND, OPTIONS = zmq.SUB, ((zmq.RCVHWM, 0), (zmq.LINGER, 0), (zmq.SUBSCRIBE, b""))
