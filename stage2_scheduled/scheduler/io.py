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
        self.receive_msg = self.offline_receive_msg
        self.send_result = self.offline_send_result

    def offline_receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        """New messages; with blocking=True the scheduler is idle and waits for at least one."""
        raise NotImplementedError("an offline front end (llm.LLM) provides the messages")

    def offline_send_result(self, reply: List[DetokenizeMsg]) -> None:
        raise NotImplementedError("an offline front end (llm.LLM) consumes the results")

    def sync_all_ranks(self) -> None:
        pass  # one rank until stage4
