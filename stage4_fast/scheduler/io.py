"""How a scheduler rank talks to the other processes. Rank 0 pulls requests from the tokenizer and pushes tokens to
the detokenizer. With tensor parallelism it republishes, once per step, the raw bytes it received as one bundle
(possibly empty) on a PUB socket that waits for every rank's subscription (``ZmqPubQueue``; upstream, a gloo broadcast
of the count, could lose the first messages and hang); every other rank reads exactly one bundle per step. Offline
(``LLM``) the subclass supplies ``offline_receive_msg`` / ``offline_send_result``, with tp > 1 publishing as rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

import msgpack

from ..message import BaseBackendMsg, BaseTokenizerMsg, BatchTokenizerMsg, ExitMsg
from ..utils.mp import ZmqPubQueue, ZmqPullQueue, ZmqPushQueue, ZmqSubQueue

if TYPE_CHECKING:
    from .config import SchedulerConfig

SUBSCRIBE_TIMEOUT_S = 600.0  # the other ranks load a model before they subscribe


class SchedulerIOMixin:
    _receive_route: Callable[..., List[BaseBackendMsg]]  # set in __init__, called with self
    _send_route: Callable[..., None]

    def __init__(self, config: SchedulerConfig, tp_cpu_group: object | None = None) -> None:
        self._io_queues: list = []
        self.tp_cpu_group = tp_cpu_group
        # class functions, not bound methods on self as upstream's: that cycle kept a deleted LLM's memory alive
        cls = type(self)
        self._offline_tp = config.offline_mode and config.tp_info.size > 1
        if config.offline_mode:
            self._receive_route = cls.offline_receive_msg
            self._send_route = cls.offline_send_result
            if config.tp_info.size > 1:  # stage 4: the offline LLM is rank 0 and broadcasts what it feeds itself
                self._send_to_ranks = self._open_broadcast(config)
                self._receive_route = cls._receive_msg_offline_rank0
            return
        tp_info = config.tp_info
        if tp_info.is_primary():
            self._recv_from_tokenizer: ZmqPullQueue[BaseBackendMsg] = ZmqPullQueue(config.zmq_backend_addr, True,
                                                                                   BaseBackendMsg.decoder)
            self._send_to_detokenizer: ZmqPushQueue[BaseTokenizerMsg] = ZmqPushQueue(
                config.zmq_detokenizer_addr, config.backend_create_detokenizer_link, BaseTokenizerMsg.encoder
            )
            self._io_queues += [self._recv_from_tokenizer, self._send_to_detokenizer]
            self._send_to_ranks: ZmqPubQueue | None = None
            if tp_info.size > 1:
                self._send_to_ranks = self._open_broadcast(config)
            self._receive_route = cls._receive_msg_rank0
            self._send_route = cls._send_result_rank0
        else:
            self._recv_from_rank0: ZmqSubQueue[BaseBackendMsg] = ZmqSubQueue(config.zmq_scheduler_broadcast_addr, False,
                                                                             BaseBackendMsg.decoder)
            self._io_queues.append(self._recv_from_rank0)
            self._receive_route = cls._receive_msg_other_rank
            self._send_route = cls._send_result_other_rank

    def receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        """New messages; with blocking=True the scheduler is idle and waits for at least one."""
        return self._receive_route(self, blocking)

    def send_result(self, reply: List[BaseTokenizerMsg]) -> None:
        self._send_route(self, reply)

    def _open_broadcast(self, config: SchedulerConfig) -> ZmqPubQueue:
        """Rank 0's PUB socket, once every other rank has subscribed (else all sockets are closed first)."""
        queue = ZmqPubQueue(config.zmq_scheduler_broadcast_addr, True, BaseBackendMsg.encoder)
        self._io_queues.append(queue)
        try:
            queue.wait_for_subscribers(config.tp_info.size - 1, SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            self.stop_io()
            raise
        return queue

    # supplied by the scheduler / the offline LLM
    def run_when_idle(self) -> None:
        raise NotImplementedError

    def offline_receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        raise NotImplementedError

    def offline_send_result(self, reply: List[BaseTokenizerMsg]) -> None:
        raise NotImplementedError

    def _receive_msg_rank0(self, blocking: bool = False) -> List[BaseBackendMsg]:
        queue = self._recv_from_tokenizer
        raws: list[bytes] = []
        if blocking:
            self.run_when_idle()
            raws.append(queue.get_raw())
        while not queue.empty():
            raws.append(queue.get_raw())
        if self._send_to_ranks is not None:
            self._send_to_ranks.put_raw(msgpack.packb(raws, use_bin_type=True))
        return [queue.decode(raw) for raw in raws]

    def _receive_msg_offline_rank0(self, blocking: bool = False) -> List[BaseBackendMsg]:
        # with nothing left the LLM raises before publishing: the other ranks wait idle for its next bundle
        msgs = self.offline_receive_msg(blocking)
        self._broadcast(msgs)
        return msgs

    def _broadcast(self, msgs: List[BaseBackendMsg]) -> None:
        raws = [msgpack.packb(BaseBackendMsg.encoder(m), use_bin_type=True) for m in msgs]
        self._send_to_ranks.put_raw(msgpack.packb(raws, use_bin_type=True))

    def stop_followers(self) -> None:
        """Offline rank 0: tell the other ranks, idle and waiting for a bundle, to leave their loops."""
        if self._offline_tp:
            self._broadcast([ExitMsg()])

    def _receive_msg_other_rank(self, blocking: bool = False) -> List[BaseBackendMsg]:
        if blocking:
            self.run_when_idle()
        # exactly one bundle per step, even when idle elsewhere: rank 0 publishes one every step
        raws = msgpack.unpackb(self._recv_from_rank0.get_raw(), raw=False)
        return [self._recv_from_rank0.decode(raw) for raw in raws]

    def _send_result_rank0(self, reply: List[BaseTokenizerMsg]) -> None:
        if reply:
            self._send_to_detokenizer.put(reply[0] if len(reply) == 1 else BatchTokenizerMsg(list(reply)))

    def _send_result_other_rank(self, reply: List[BaseTokenizerMsg]) -> None:
        pass  # only rank 0 talks to the detokenizer

    def sync_all_ranks(self) -> None:
        if self.tp_cpu_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.tp_cpu_group)

    def stop_io(self) -> None:
        for queue in self._io_queues:
            queue.stop()
        self._io_queues = []
