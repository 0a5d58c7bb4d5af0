"""--enable-log-requests: a line when a request is submitted and one when it ends, however it ends
(server/request_log.py, written by FrontendManager)."""

from __future__ import annotations

import asyncio
import logging
from typing import List

import httpx
import pytest

from stage4_fast.core import SamplingParams
from stage4_fast.message.frontend import UserReply
from stage4_fast.server.frontend import BackendUnavailable, FrontendManager
from stage4_fast.server.request_log import RequestLog, changed_fields

from .test_sse_stream import frontend


def _frontend(max_len: int | None = None) -> FrontendManager:
    """test_sse_stream's FrontendManager without sockets, submitting and logging its requests."""
    fm, _ = frontend()
    fm.max_requests, fm.uid_counter = 8, iter(range(100))
    fm.request_log = RequestLog(max_len)
    return fm


def _lines(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stage4_fast.server.request_log"]


def _run(fm: FrontendManager, replies: List[UserReply | None], read: int | None = None) -> None:
    """Submit a request, feed it ``replies`` and read ``read`` of them (all by default), as a stream would."""
    async def run() -> None:
        uid = fm.submit([5, 6, 7, 8], SamplingParams(temperature=0.5, max_tokens=3))
        for r in replies:
            fm.ack_map[uid].put_nowait(r if r is None else UserReply(**{**r.__dict__, "uid": uid}))
        stream = fm.replies(uid)
        try:
            for _ in range(read if read is not None else len(replies)):
                await stream.__anext__()
        except (StopAsyncIteration, BackendUnavailable):
            pass
        finally:
            await stream.aclose()

    asyncio.run(run())


def _reply(text: str, finished: bool, tokens: int, error: str | None = None) -> UserReply:
    return UserReply(0, text, finished, finish_reason="length" if finished else "", prompt_tokens=4,
                     completion_tokens=tokens, error=error)


def test_changed_fields_names_only_what_differs_from_the_defaults():
    assert changed_fields(SamplingParams()) == {}
    assert changed_fields(SamplingParams(temperature=0.5, stop_token_ids=[7])) == {"temperature": 0.5,
                                                                                  "stop_token_ids": [7]}


@pytest.mark.parametrize("max_len, shown", [(None, "'abcdef'"), (3, "'abc' (+3 more)"), (6, "'abcdef'")])
def test_a_prompt_is_cut_to_the_max_log_len(max_len, shown):
    assert RequestLog(max_len).shown_prompt("abcdef") == shown
    assert RequestLog(2).shown_prompt([1, 2, 3]) == "[1, 2] (+1 more)"  # token ids count one each
    messages = [{"role": "user", "content": "Hi"}]  # a chat's messages: their repr, cut by characters
    assert RequestLog(None).shown_prompt(messages) == repr(messages)
    assert RequestLog(11).shown_prompt(messages) == "[{'role': ' (+24 more characters)"


def test_a_finished_request_logs_its_arrival_and_its_end(caplog):
    caplog.set_level(logging.INFO, logger="stage4_fast.server.request_log")
    _run(_frontend(max_len=2), [_reply("a", False, 1), _reply("b", False, 2), _reply("c", True, 3)])
    received, ended = _lines(caplog)
    assert received == "request 0 received: prompt [5, 6] (+2 more), params {'temperature': 0.5, 'max_tokens': 3}"
    assert ended.startswith("request 0 finished (length) in ") and ended.endswith(": 4 prompt + 3 completion tokens")


@pytest.mark.parametrize("replies, read, says", [
    ([_reply("a", False, 1), _reply("b", False, 2)], 1, "aborted after"),  # the client left after one chunk
    ([_reply("", True, 0, error="prompt too long")], None, "rejected: prompt too long"),
    ([_reply("a", False, 1), None], None, "failed after"),  # a worker died
])
def test_every_other_end_is_logged_as_what_it_was(caplog, replies, read, says):
    caplog.set_level(logging.INFO, logger="stage4_fast.server.request_log")
    _run(_frontend(), replies, read)
    lines = _lines(caplog)
    assert len(lines) == 2 and says in lines[1], lines


def test_the_end_user_a_client_names_is_in_the_line(caplog, tools_server):
    """OpenAI's ``user`` field (an id of the client's end user) is what the log shows with the request."""
    caplog.set_level(logging.INFO, logger="stage4_fast.server.request_log")
    fm = _frontend()
    fm.submit("hi", SamplingParams(), user="alice")
    assert _lines(caplog) == ["request 0 received from user 'alice': prompt 'hi', params {}"]
    for path, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{tools_server.base_url}/v1/{path}", json={**body, "max_tokens": 1, "user": f"u-{path}"},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert f"from user 'u-{path}'" in tools_server.log()
    fm = _frontend(max_len=3)
    fm.submit("hi", SamplingParams(), user="bob-1234")  # cut as a prompt is
    assert _lines(caplog)[-1] == "request 0 received from user 'bob' (+5 more): prompt 'hi', params {}"


def test_no_line_without_the_flag(caplog):
    caplog.set_level(logging.INFO, logger="stage4_fast.server.request_log")
    fm = _frontend()
    fm.request_log = None
    _run(fm, [_reply("a", True, 1)])
    assert _lines(caplog) == []
