"""ZMQ queues, and the PUB/SUB broadcast fix: a rank that subscribes late still gets the first message."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import torch
import zmq

from stage4_fast.core import SamplingParams
from stage4_fast.distributed import DistributedInfo
from stage4_fast.message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    StatsBackendMsg,
    UserMsg,
)
from stage4_fast.scheduler import io as io_module
from stage4_fast.scheduler.io import SchedulerIOMixin
from stage4_fast.utils.mp import (
    ZmqAsyncPullQueue,
    ZmqAsyncPushQueue,
    ZmqPubQueue,
    ZmqPullQueue,
    ZmqPushQueue,
    ZmqSubQueue,
)


def _addr() -> str:
    return f"ipc:///tmp/s3test-{uuid.uuid4().hex[:12]}"


def _user(uid: int) -> UserMsg:
    return UserMsg(uid, torch.tensor([uid, 1, 2], dtype=torch.int32), SamplingParams(max_tokens=uid + 1))


def _key(msg) -> tuple:
    return (type(msg).__name__, msg.uid)


def test_push_pull_keeps_order_and_content():
    addr = _addr()
    pull = ZmqPullQueue(addr, True, BaseBackendMsg.decoder)
    push = ZmqPushQueue(addr, False, BaseBackendMsg.encoder)
    try:
        assert pull.empty()
        sent = [_user(i) if i % 2 else AbortBackendMsg(i) for i in range(200)]
        for m in sent:
            push.put(m)
        got = [pull.get() for _ in sent]
        assert [_key(m) for m in got] == [_key(m) for m in sent]
        assert torch.equal(got[1].input_ids, sent[1].input_ids)
        assert pull.empty()
    finally:
        push.stop()
        pull.stop()


def test_async_push_pull():
    async def main() -> list:
        addr = _addr()
        pull = ZmqAsyncPullQueue(addr, True, BaseBackendMsg.decoder)
        push = ZmqAsyncPushQueue(addr, False, BaseBackendMsg.encoder)
        try:
            await push.put(AbortBackendMsg(1))
            push.put_nowait(StatsBackendMsg(2))
            return [await asyncio.wait_for(pull.get(), 5) for _ in range(2)]
        finally:
            push.stop()
            pull.stop()

    assert [_key(m) for m in asyncio.run(main())] == [("AbortBackendMsg", 1), ("StatsBackendMsg", 2)]


def test_upstream_pub_drops_what_it_sends_before_a_subscriber_joins():
    """The slow-joiner behaviour the fix is about (characterises ZMQ, so a regression test can rely on it)."""
    addr = _addr()
    pub = ZmqPubQueue(addr, True, BaseBackendMsg.encoder)
    try:
        pub.put(AbortBackendMsg(0))  # upstream: published right after start-up, before the rank subscribed
        sub = ZmqSubQueue(addr, False, BaseBackendMsg.decoder)
        try:
            pub.wait_for_subscribers(1, timeout_s=10)
            pub.put(AbortBackendMsg(1))
            assert sub.get().uid == 1  # message 0 is gone for good
            assert sub.socket.poll(200) == 0
        finally:
            sub.stop()
    finally:
        pub.stop()


def test_wait_for_subscribers_returns_once_they_joined():
    addr = _addr()
    pub = ZmqPubQueue(addr, True, BaseBackendMsg.encoder)
    subs = [ZmqSubQueue(addr, False, BaseBackendMsg.decoder) for _ in range(2)]
    try:
        for sub in subs:
            sub.socket.setsockopt(zmq.RCVTIMEO, 5000)
        pub.wait_for_subscribers(2, timeout_s=10)
        assert pub.num_subscribers == 2
        pub.put(AbortBackendMsg(1))  # sent after the handshake: every subscriber gets it
        assert [_key(sub.get()) for sub in subs] == [("AbortBackendMsg", 1)] * 2
    finally:
        for queue in (pub, *subs):
            queue.stop()


def test_wait_for_subscribers_times_out_clearly():
    pub = ZmqPubQueue(_addr(), True, BaseBackendMsg.encoder)
    try:
        with pytest.raises(TimeoutError, match="0 of 1 subscribers"):
            pub.wait_for_subscribers(1, timeout_s=0.2)
    finally:
        pub.stop()


def test_the_binding_queue_removes_its_ipc_file_on_stop():
    """libzmq leaves an ipc:// socket file behind when the socket closes; the queue that bound it removes it."""
    addr = _addr()
    path = addr.removeprefix("ipc://")
    pull = ZmqPullQueue(addr, True, BaseBackendMsg.decoder)
    push = ZmqPushQueue(addr, False, BaseBackendMsg.encoder)
    assert os.path.exists(path)
    push.stop()
    assert os.path.exists(path)  # a connecting queue leaves the binder's file alone
    pull.stop()
    assert not os.path.exists(path)


@dataclass(frozen=True)
class _Config:
    tp_info: DistributedInfo
    zmq_backend_addr: str
    zmq_detokenizer_addr: str
    zmq_scheduler_broadcast_addr: str
    offline_mode: bool = False
    backend_create_detokenizer_link: bool = True


class _Rank(SchedulerIOMixin):
    def __init__(self, config: _Config) -> None:
        self.idle_calls = 0
        super().__init__(config)

    def run_when_idle(self) -> None:
        self.idle_calls += 1


def _late_rank_scenario(tp: int = 3, late_s: float = 0.5, recv_timeout_ms: int = 5000) -> tuple[list, list]:
    """Ranks 1..tp-1 start ``late_s`` after rank 0; rank 0 receives three steps of messages. Returns what rank 0
    and each other rank saw per step (a rank that waited too long for a bundle records 'timeout')."""
    addrs = dict(zmq_backend_addr=_addr(), zmq_detokenizer_addr=_addr(), zmq_scheduler_broadcast_addr=_addr())
    seen: dict[int, list] = {r: [] for r in range(1, tp)}

    def other_rank(rank: int) -> None:
        time.sleep(late_s)
        r = _Rank(_Config(DistributedInfo(rank, tp), **addrs))
        r._recv_from_rank0.socket.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
        try:
            for step in range(3):
                try:
                    seen[rank].append([_key(m) for m in r.receive_msg(blocking=step == 0)])
                except zmq.Again:
                    seen[rank].append("timeout")
        finally:
            r.stop_io()

    threads = [threading.Thread(target=other_rank, args=(k,)) for k in range(1, tp)]
    for t in threads:
        t.start()
    rank0 = _Rank(_Config(DistributedInfo(0, tp), **addrs))  # blocks until every other rank subscribed
    detok = ZmqPullQueue(addrs["zmq_detokenizer_addr"], False, BaseTokenizerMsg.decoder)
    push = ZmqPushQueue(addrs["zmq_backend_addr"], False, BaseBackendMsg.encoder)
    steps: list = []
    try:
        push.put(_user(1))
        steps.append([_key(m) for m in rank0.receive_msg(blocking=True)])
        steps.append([_key(m) for m in rank0.receive_msg(blocking=False)])  # nothing new: an empty bundle
        push.put(_user(2))
        push.put(AbortBackendMsg(1))
        time.sleep(0.1)
        steps.append([_key(m) for m in rank0.receive_msg(blocking=False)])
        rank0.send_result([DetokenizeMsg(2, 5, False), DetokenizeMsg(1, -1, True, "aborted", "abort")])
        out = detok.get()
        assert isinstance(out, BatchTokenizerMsg) and [m.uid for m in out.data] == [2, 1]
        assert rank0.idle_calls == 1
    finally:
        for t in threads:
            t.join(30)
        for q in (push, detok):
            q.stop()
        rank0.stop_io()
    return steps, [seen[r] for r in range(1, tp)]


def test_rank0_whose_ranks_never_subscribe_leaves_no_ipc_file(monkeypatch):
    monkeypatch.setattr(io_module, "SUBSCRIBE_TIMEOUT_S", 0.2)
    addrs = dict(zmq_backend_addr=_addr(), zmq_detokenizer_addr=_addr(), zmq_scheduler_broadcast_addr=_addr())
    with pytest.raises(TimeoutError):
        _Rank(_Config(DistributedInfo(0, 2), **addrs))
    assert not any(os.path.exists(a.removeprefix("ipc://")) for a in addrs.values())


def test_ranks_that_subscribe_late_get_every_step_from_the_first():
    """Regression test for upstream's PUB/SUB broadcast (no subscriber handshake): with the handshake removed
    (``ZmqPubQueue.wait_for_subscribers`` a no-op, i.e. upstream's barrier-only start) the late ranks miss step 1
    and this fails."""
    steps, others = _late_rank_scenario()
    assert steps == [[("UserMsg", 1)], [], [("UserMsg", 2), ("AbortBackendMsg", 1)]]
    for seen in others:
        assert seen == steps


def test_without_the_handshake_the_late_rank_loses_step_one(monkeypatch):
    """The same scenario with upstream's behaviour: proves the test above can fail."""
    monkeypatch.setattr(ZmqPubQueue, "wait_for_subscribers", lambda self, n, timeout_s=0: None)
    steps, others = _late_rank_scenario(tp=2, recv_timeout_ms=300)
    assert others[0] != steps
    assert others[0][0] != [("UserMsg", 1)]
