"""Where the scheduler's messages come from and where its results go.

Stage 2 runs offline only: the `LLM` subclass feeds requests and collects results in-process. The next stage adds
the ZMQ sockets (and TP broadcast) behind these same two methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from ..message import BaseBackendMsg, DetokenizeMsg
    from .config import SchedulerConfig


class SchedulerIOMixin:
    def __init__(self, config: SchedulerConfig) -> None:
        if not config.offline_mode:
            raise NotImplementedError("the scheduler's ZMQ IO arrives in stage3; stage2 runs offline (llm.LLM)")

    # Methods rather than upstream's bound methods stored on the object (`self.receive_msg =
    # self.offline_receive_msg`): those form a reference cycle, which kept a deleted LLM and its memory alive until
    # the garbage collector ran.
    def receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        return self.offline_receive_msg(blocking)

    def send_result(self, reply: List[DetokenizeMsg]) -> None:
        self.offline_send_result(reply)

    def offline_receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        """New messages; with blocking=True the scheduler is idle and waits for at least one."""
        raise NotImplementedError("an offline front end (llm.LLM) provides the messages")

    def offline_send_result(self, reply: List[DetokenizeMsg]) -> None:
        raise NotImplementedError("an offline front end (llm.LLM) consumes the results")

    def sync_all_ranks(self) -> None:
        pass  # one rank until stage4
