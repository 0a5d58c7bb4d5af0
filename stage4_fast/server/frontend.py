"""The API server's end of the pipes: send requests to the tokenizer worker(s), route replies back by uid."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, List

from ..message.frontend import BaseFrontendMsg, BatchFrontendMsg, StatsReply, UserReply
from ..message.tokenizer import AbortMsg, BaseTokenizerMsg, StatsQueryMsg, TokenizeMsg
from ..utils.mp import ZmqAsyncPullQueue, ZmqAsyncPushQueue
from .args import ServerArgs
from .metrics import ServerMetrics
from .request_log import RequestLog

logger = logging.getLogger(__name__)


class RequestRejected(Exception):
    """The tokenizer or the scheduler refused the request (bad prompt, too long, can never fit)."""


class BackendUnavailable(Exception):
    """A worker died; the server is going down."""


class QueueFull(Exception):
    """More requests are waiting than --max-queued-requests allows; the client should retry later (503)."""


class FrontendManager:
    """Made inside its event loop (zmq.asyncio sockets belong to a loop). Process ``api_index`` of N hands out the
    uids ``api_index + k * N``: the workers route a reply by ``uid % N``."""

    def __init__(self, config: ServerArgs, metrics: ServerMetrics | None = None, api_index: int = 0) -> None:
        self.config = config
        self.metrics = metrics
        self.api_index, self.api_count = api_index, config.api_server_count
        # the running requests plus a bounded queue (not upstream), shared out over the API server processes
        self.max_requests = -(-(config.max_running_req + config.max_queued_requests) // self.api_count)
        self.num_requests = 0
        self.submit_time: Dict[int, float] = {}
        self.request_log = RequestLog(config.max_log_len) if config.log_requests else None
        self.send_tokenizer: List[ZmqAsyncPushQueue[BaseTokenizerMsg]] = [
            ZmqAsyncPushQueue(addr, False, BaseTokenizerMsg.encoder) for addr in config.zmq_tokenizer_addrs]
        self.recv_tokenizer: ZmqAsyncPullQueue[BaseFrontendMsg] = ZmqAsyncPullQueue(
            config.zmq_frontend_addrs[api_index], True, BaseFrontendMsg.decoder)
        self.uid_counter = itertools.count(api_index, self.api_count)
        # uid -> its replies; None in a queue means "the backend is gone"
        self.ack_map: Dict[int, asyncio.Queue[UserReply | StatsReply | None]] = {}
        self.dead_reason: str | None = None
        self._listen_task = asyncio.get_running_loop().create_task(self.listen())

    async def listen(self) -> None:
        while True:
            try:
                msg = await self.recv_tokenizer.get()
            except Exception:  # one undecodable message must not stop every later reply
                logger.exception("frontend: dropping a message it cannot decode")
                continue
            for reply in msg.data if isinstance(msg, BatchFrontendMsg) else [msg]:
                if (queue := self.ack_map.get(reply.uid)) is not None:  # an aborted request's replies are dropped
                    queue.put_nowait(reply)

    def _send(self, uid: int, msg: BaseTokenizerMsg) -> None:
        # a request and its abort take the same worker, so they stay in order; uid // api_count: every worker in turn
        self.send_tokenizer[uid // self.api_count % len(self.send_tokenizer)].put_nowait(msg)

    def _new_uid(self) -> int:
        if self.dead_reason is not None:
            raise BackendUnavailable(self.dead_reason)
        uid = next(self.uid_counter)
        self.ack_map[uid] = asyncio.Queue()
        return uid

    def submit(self, prompt: Any, sampling_params: Any, chat_options: Dict[str, Any] | None = None,
               user: str | None = None) -> int:
        if self.dead_reason is None and self.num_requests >= self.max_requests:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise QueueFull(f"{self.num_requests} requests are in flight, the limit is {self.max_requests}")
        uid = self._new_uid()
        self.num_requests += 1
        if self.metrics is not None:
            self.metrics.inflight.set(self.num_requests)
        self.submit_time[uid] = time.perf_counter()
        try:
            self._send(uid, TokenizeMsg(uid, prompt, sampling_params, chat_options))
        except BaseException:  # e.g. a value the encoder cannot carry: the request never left, forget it
            self.ack_map.pop(uid, None)
            self._release(uid)
            raise
        if self.request_log is not None:
            self.request_log.received(uid, prompt, sampling_params, user)
        return uid

    async def replies(self, uid: int, keep_apart_after: int = 0) -> AsyncIterator[UserReply]:
        """The request's replies up to the finished one; however the consumer stops, the entry is removed and an
        unfinished request aborted. Replies that queued up meanwhile are merged into one (as vLLM's output collector),
        but not across ``keep_apart_after`` completion tokens (min_tokens' stop strings count only after them)."""
        queue = self.ack_map[uid]
        finished = backend_gone = False
        last = started = self.submit_time.get(uid)
        first = True
        final: UserReply | None = None  # the latest reply given out (its usage counts every token so far)
        held: Deque[UserReply | StatsReply | None] = deque()  # taken from the queue but not mergeable
        try:
            while True:
                reply = held.popleft() if held else await queue.get()
                while isinstance(reply, UserReply) and not (reply.finished or reply.error) and not queue.empty():
                    later = queue.get_nowait()
                    if not isinstance(later, UserReply) or later.error:
                        held.append(later)  # an error or "backend gone" comes after the text before it
                        break
                    if reply.completion_tokens <= keep_apart_after < later.completion_tokens:
                        held.append(later)
                        break
                    reply = reply.followed_by(later)
                if self.metrics is not None and reply is not None and last is not None:
                    now = time.perf_counter()
                    (self.metrics.ttft if first else self.metrics.itl).observe(now - last)
                    first, last = False, now
                if reply is None:
                    finished = backend_gone = True  # nothing left to abort
                    raise BackendUnavailable(self.dead_reason or "the server is shutting down")
                assert isinstance(reply, UserReply)
                finished = reply.finished
                if finished and self.metrics is not None and not reply.error:
                    self.metrics.prompt_tokens.inc(reply.prompt_tokens)
                    self.metrics.generation_tokens.inc(reply.completion_tokens)
                final = reply
                yield reply
                if finished:
                    return
        finally:
            self.ack_map.pop(uid, None)
            self._release(uid)
            if not finished:
                self.abort_user(uid)
            if self.request_log is not None and started is not None:
                self.request_log.ended(uid, final, finished, backend_gone, time.perf_counter() - started)

    def abandon(self, uid: int) -> None:
        """A submitted request whose replies were never read: removed and aborted."""
        started = self.submit_time.get(uid)
        if uid not in self.ack_map:
            return
        self.abort_user(uid)
        if self.request_log is not None and started is not None:
            self.request_log.ended(uid, None, False, False, time.perf_counter() - started)

    def _release(self, uid: int) -> None:
        if self.submit_time.pop(uid, None) is not None:
            self.num_requests -= 1
            if self.metrics is not None:
                self.metrics.inflight.set(self.num_requests)

    def abort_user(self, uid: int) -> None:
        """Synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks, where awaiting is unsafe."""
        self.ack_map.pop(uid, None)
        self._release(uid)
        if self.dead_reason is None:
            self._send(uid, AbortMsg(uid))

    async def query_stats(self, timeout_s: float = 10.0) -> Dict[str, Any]:
        uid = self._new_uid()
        try:
            self._send(uid, StatsQueryMsg(uid))
            reply = await asyncio.wait_for(self.ack_map[uid].get(), timeout_s)
        finally:
            self.ack_map.pop(uid, None)
        if not isinstance(reply, StatsReply):
            raise BackendUnavailable(self.dead_reason or "no stats from the scheduler")
        return reply.stats

    def fail_all(self, reason: str) -> None:
        """Called when a worker died: every waiting request ends with an error, new ones are refused."""
        self.dead_reason = reason
        for queue in self.ack_map.values():
            queue.put_nowait(None)

    @property
    def num_inflight(self) -> int:
        return len(self.ack_map)

    def shutdown(self) -> None:
        self._listen_task.cancel()
        for queue in [*self.send_tokenizer, self.recv_tokenizer]:
            queue.stop()
