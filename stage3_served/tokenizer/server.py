"""The tokenizer / detokenizer worker process."""

from __future__ import annotations

import logging
from typing import Any, List

from ..message import (
    AbortMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    StatsMsg,
    StatsQueryMsg,
    TokenizeMsg,
)
from ..message.backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, StatsBackendMsg, UserMsg
from ..message.frontend import BaseFrontendMsg, BatchFrontendMsg, StatsReply, UserReply
from ..utils.hf import load_tokenizer
from ..utils.mp import ZmqPullQueue, ZmqPushQueue
from .detokenize import DetokenizeManager
from .tokenize import TokenizeManager

logger = logging.getLogger(__name__)


def _unwrap(msg: BaseTokenizerMsg) -> List[BaseTokenizerMsg]:
    return list(msg.data) if isinstance(msg, BatchTokenizerMsg) else [msg]


def _wrap(msgs: list, batch_cls: type) -> Any:
    # single messages travel unwrapped, as upstream
    return msgs[0] if len(msgs) == 1 else batch_cls(msgs)


def tokenize_worker(*, tokenizer_path: str, addr: str, create: bool, backend_addr: str, frontend_addr: str,
                    local_bs: int, tokenizer_id: int = -1, ack_queue: Any = None) -> None:
    """Pull requests and tokens on ``addr``; push token ids to the scheduler, text to the request's API server."""
    tokenizer = load_tokenizer(tokenizer_path)
    tokenize_manager = TokenizeManager(tokenizer)
    detokenize_manager = DetokenizeManager(tokenizer)
    send_backend: ZmqPushQueue[BaseBackendMsg] = ZmqPushQueue(backend_addr, False, BaseBackendMsg.encoder)
    send_frontend: ZmqPushQueue[BaseFrontendMsg] = ZmqPushQueue(frontend_addr, False, BaseFrontendMsg.encoder)
    recv: ZmqPullQueue[BaseTokenizerMsg] = ZmqPullQueue(addr, create, BaseTokenizerMsg.decoder)
    if ack_queue is not None:
        ack_queue.put({"name": f"tokenizer-{tokenizer_id}"})
    try:
        while True:
            msgs = _unwrap(recv.get())
            while len(msgs) < local_bs and not recv.empty():
                msgs.extend(_unwrap(recv.get()))
            to_frontend, to_backend = _handle(msgs, tokenize_manager, detokenize_manager)
            if to_frontend:
                send_frontend.put(_wrap(to_frontend, BatchFrontendMsg))
            if to_backend:
                send_backend.put(_wrap(to_backend, BatchBackendMsg))
    finally:
        for queue in (recv, send_backend, send_frontend):
            queue.stop()


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
                input_ids = tokenize_manager.tokenize_one(msg.text)
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
