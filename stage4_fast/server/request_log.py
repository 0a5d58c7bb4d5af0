"""``--enable-log-requests``: a log line when a request is submitted and one when it ends (for debugging)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict

from ..message.frontend import UserReply

logger = logging.getLogger(__name__)


def changed_fields(params: Any) -> Dict[str, Any]:
    """The fields of a dataclass that differ from their defaults (a request's sampling parameters, readably)."""
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(params)}
    return {name: value for name, default in defaults.items() if (value := getattr(params, name)) != default}


@dataclass
class RequestLog:
    max_len: int | None = None  # prompt characters or token ids shown (None: all of it)

    def shown_prompt(self, prompt: Any) -> str:
        """Text (quoted) or token ids cut to ``max_len``; a chat's messages as their repr, cut alike."""
        if isinstance(prompt, str) or all(type(t) is int for t in prompt):
            head = prompt[: self.max_len]
            return repr(head) + (f" (+{len(prompt) - len(head)} more)" if len(head) < len(prompt) else "")
        text = repr(prompt)
        head = text[: self.max_len]
        return head + (f" (+{len(text) - len(head)} more characters)" if len(head) < len(text) else "")

    def received(self, uid: int, prompt: Any, sampling_params: Any, user: str | None = None) -> None:
        """``user``: OpenAI's end-user id when the client sent one, cut as a prompt is."""
        logger.info("request %d received%s: prompt %s, params %s", uid,
                    f" from user {self.shown_prompt(user)}" if user else "",
                    self.shown_prompt(prompt), changed_fields(sampling_params))

    def ended(self, uid: int, last: UserReply | None, finished: bool, backend_gone: bool, seconds: float) -> None:
        """``finished``: ``last`` was the finishing reply; ``backend_gone``: a worker was lost or the server stops."""
        tokens = f"{last.prompt_tokens} prompt + {last.completion_tokens} completion tokens" if last else "no tokens"
        if backend_gone:
            logger.info("request %d failed after %.3f s: the backend is gone (%s)", uid, seconds, tokens)
        elif last is not None and last.error:
            logger.info("request %d rejected: %s", uid, last.error)
        elif finished and last is not None:
            logger.info("request %d finished (%s) in %.3f s: %s", uid, last.finish_reason, seconds, tokens)
        else:
            logger.info("request %d aborted after %.3f s (its client left): %s", uid, seconds, tokens)
