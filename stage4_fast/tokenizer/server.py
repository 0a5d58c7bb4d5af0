"""The tokenizer / detokenizer worker process."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

from ..message import (
    AbortMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    StatsMsg,
    StatsQueryMsg,
    TokenizeMsg,
    expand_columns,
)
from ..message.backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, StatsBackendMsg, UserMsg
from ..message.frontend import BaseFrontendMsg, BatchFrontendMsg, StatsReply, UserReply
from ..utils.hf import load_tokenizer
from ..utils.mp import ZmqPullQueue, ZmqPushQueue
from ..utils.process import freeze_startup_heap
from .detokenize import DetokenizeManager
from .tokenize import TokenizeManager

logger = logging.getLogger(__name__)


def _unwrap(msg: BaseTokenizerMsg) -> List[BaseTokenizerMsg]:
    return expand_columns(list(msg.data) if isinstance(msg, BatchTokenizerMsg) else [msg])


def _wrap(msgs: list, batch_cls: type) -> Any:
    # single messages travel unwrapped, as upstream
    return msgs[0] if len(msgs) == 1 else batch_cls(msgs)


def tokenize_worker(*, tokenizer_path: str, addr: str, create: bool, backend_addr: str, frontend_addrs: List[str],
                    local_bs: int, tokenizer_id: int = -1, ack_queue: Any = None) -> None:
    """Pull requests and tokens on ``addr``; push token ids to the scheduler, text to the request's API server."""
    tokenizer = load_tokenizer(tokenizer_path)
    tokenize_manager = TokenizeManager(tokenizer)
    detokenize_manager = DetokenizeManager(tokenizer)
    send_backend: ZmqPushQueue[BaseBackendMsg] = ZmqPushQueue(backend_addr, False, BaseBackendMsg.encoder)
    send_frontend: List[ZmqPushQueue[BaseFrontendMsg]] = [ZmqPushQueue(a, False, BaseFrontendMsg.encoder)
                                                          for a in frontend_addrs]
    recv: ZmqPullQueue[BaseTokenizerMsg] = ZmqPullQueue(addr, create, BaseTokenizerMsg.decoder)
    freeze_startup_heap()  # before the ack: the first request must not wait for its collection
    if ack_queue is not None:
        ack_queue.put({"name": f"tokenizer-{tokenizer_id}"})
    try:
        while True:
            msgs = _unwrap(recv.get())
            while len(msgs) < local_bs and not recv.empty():
                msgs.extend(_unwrap(recv.get()))
            to_frontend, to_backend = _handle(msgs, tokenize_manager, detokenize_manager)
            for index, replies in _by_api_server(to_frontend, len(send_frontend)):
                send_frontend[index].put(_wrap(replies, BatchFrontendMsg))
            if to_backend:
                send_backend.put(_wrap(to_backend, BatchBackendMsg))
    finally:
        for queue in (recv, send_backend, *send_frontend):
            queue.stop()


def _by_api_server(replies: List[BaseFrontendMsg], count: int) -> List[Tuple[int, List[BaseFrontendMsg]]]:
    if count == 1:
        return [(0, replies)] if replies else []
    groups: Dict[int, List[BaseFrontendMsg]] = {}
    for reply in replies:
        groups.setdefault(reply.uid % count, []).append(reply)
    return list(groups.items())


def _handle(msgs: List[BaseTokenizerMsg], tokenize_manager: TokenizeManager,
            detokenize_manager: DetokenizeManager) -> tuple[list[BaseFrontendMsg], list[BaseBackendMsg]]:
    to_frontend: list[BaseFrontendMsg] = []
    to_backend: list[BaseBackendMsg] = []
    detok = [m for m in msgs if isinstance(m, DetokenizeMsg)]
    if detok:
        to_frontend.extend(detokenize_manager.detokenize(detok))
    # everything bound for the scheduler keeps its arrival order, so an abort never overtakes its request
    for msg in msgs:
        if isinstance(msg, TokenizeMsg):
            try:
                input_ids = tokenize_manager.tokenize_one(msg.text, msg.chat_options)
            except Exception as e:  # a bad prompt must cost one request, never the worker
                to_frontend.append(UserReply(msg.uid, "", True, finish_reason="error", error=str(e)))
                continue
            to_backend.append(UserMsg(msg.uid, input_ids, msg.sampling_params))
        elif isinstance(msg, AbortMsg):
            to_backend.append(AbortBackendMsg(msg.uid))
        elif isinstance(msg, StatsQueryMsg):
            to_backend.append(StatsBackendMsg(msg.uid))
        elif isinstance(msg, StatsMsg):
            to_frontend.append(StatsReply(msg.uid, msg.stats))
        elif not isinstance(msg, DetokenizeMsg):
            logger.warning("tokenizer worker: ignoring unexpected %s", type(msg).__name__)
    return to_frontend, to_backend
