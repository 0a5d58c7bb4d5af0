"""The SSE stream and abort on disconnect, without a server: `_sse_stream` turns a request's deltas (stage 4: each
choice's) into OpenAI's event stream and always closes them; `FrontendManager.replies` aborts a request whose
consumer stops early (a client that disconnects cancels the stream), and only then."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, List

from stage4_fast.message import AbortMsg
from stage4_fast.message.frontend import UserReply
from stage4_fast.server.api_server import _sse_stream
from stage4_fast.server.frontend import BackendUnavailable, FrontendManager
from stage4_fast.server.stream import Delta


class FakeDeltas:
    """An async iterator of deltas that records whether it was closed (closing aborts the request upstream)."""

    def __init__(self, deltas: List[Delta], fail_after: int | None = None) -> None:
        self.deltas, self.fail_after, self.closed = list(deltas), fail_after, False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if self.fail_after is not None and self.fail_after == 0:
            raise BackendUnavailable("worker died")
        if self.fail_after is not None:
            self.fail_after -= 1
        if not self.deltas:
            raise StopAsyncIteration
        return self.deltas.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def delta(text: str, finish: str | None = None) -> Delta:
    return Delta(text, finish, prompt_tokens=3, completion_tokens=2, cached_tokens=0)


def events(first: Delta, rest: FakeDeltas, head: bool = False, usage: bool = True) -> List[str]:
    async def run() -> List[str]:
        chunk = lambda i, d: {"text": None if d is None else d.text}  # noqa: E731
        usage_chunk = (lambda finals: {"usage": sum(d.completion_tokens for d in finals)}) if usage else None
        heads = [chunk(0, None)] if head else []
        return [e async for e in _sse_stream([first], [rest], chunk, usage_chunk, heads)]

    return asyncio.run(run())


def test_stream_is_head_chunks_usage_then_done():
    rest = FakeDeltas([delta(""), delta("lo", "stop")])
    got = events(delta("Hel"), rest, head=True)
    assert [json.loads(e[len("data: "):]) for e in got[:-1]] == [
        {"text": None}, {"text": "Hel"}, {"text": "lo"}, {"usage": 2}]  # the empty delta sends nothing
    assert got[-1] == b"data: [DONE]\n\n" and all(e.endswith(b"\n\n") for e in got)
    assert rest.closed


def test_a_backend_failure_mid_stream_is_an_error_event_then_done():
    rest = FakeDeltas([delta("more")], fail_after=1)
    got = events(delta("Hi"), rest, usage=False)
    assert json.loads(got[0][len("data: "):]) == {"text": "Hi"}
    assert json.loads(got[2][len("data: "):])["error"]["message"]
    assert got[-1] == b"data: [DONE]\n\n" and rest.closed


def test_a_consumer_that_stops_early_closes_the_deltas():
    """A client that disconnects: the server stops iterating the body and closes it."""
    rest = FakeDeltas([delta("a"), delta("b"), delta("c", "length")])

    async def run() -> None:
        stream = _sse_stream([delta("x")], [rest], lambda i, d: {"t": d.text}, None)
        assert (await stream.__anext__()).startswith(b"data: ")
        await stream.aclose()

    asyncio.run(run())
    assert rest.closed


def test_choices_stream_as_they_come_and_usage_waits_for_all():
    """n > 1: every choice's chunks carry its index; the usage comes once every choice has finished."""
    a, b = FakeDeltas([delta("a2"), delta("a3", "length")]), FakeDeltas([delta("b2", "stop")])

    async def run() -> List[str]:
        chunk = lambda i, d: {"i": i, "text": d.text}  # noqa: E731
        return [e async for e in _sse_stream([delta("a1"), delta("b1")], [a, b], chunk,
                                             lambda finals: {"usage": len(finals)})]

    got = [json.loads(e[len("data: "):]) for e in asyncio.run(run())[:-1]]
    assert [c["text"] for c in got if c.get("i") == 0] == ["a1", "a2", "a3"]
    assert [c["text"] for c in got if c.get("i") == 1] == ["b1", "b2"]
    assert got[-1] == {"usage": 2} and a.closed and b.closed


def frontend() -> tuple[FrontendManager, list]:
    """A FrontendManager without sockets: what it sends to the tokenizer worker is recorded."""
    fm = FrontendManager.__new__(FrontendManager)
    sent: list = []
    fm.metrics, fm.dead_reason, fm.ack_map, fm.submit_time, fm.num_requests = None, None, {}, {}, 0
    fm.request_log = None
    fm._send = lambda uid, msg: sent.append(msg)  # type: ignore[method-assign]
    return fm, sent


def reply(uid: int, text: str, finished: bool) -> UserReply:
    return UserReply(uid, text, finished, finish_reason="stop" if finished else "")


def test_replies_stop_at_the_finished_one_and_abort_nothing():
    fm, sent = frontend()

    async def run() -> List[str]:
        fm.ack_map[7] = queue = asyncio.Queue()
        replies = fm.replies(7)
        queue.put_nowait(reply(7, "a", False))
        got = [(await replies.__anext__()).incremental_output]
        queue.put_nowait(reply(7, "b", True))
        return got + [r.incremental_output async for r in replies]

    assert asyncio.run(run()) == ["a", "b"]
    assert sent == [] and 7 not in fm.ack_map


def test_a_consumer_that_stops_early_aborts_the_request():
    fm, sent = frontend()

    async def run() -> None:
        fm.ack_map[7] = queue = asyncio.Queue()
        queue.put_nowait(reply(7, "a", False))
        replies = fm.replies(7)
        assert (await replies.__anext__()).incremental_output == "a"
        await replies.aclose()  # what a disconnect does to the stream that iterates it

    asyncio.run(run())
    assert [type(m) for m in sent] == [AbortMsg] and sent[0].uid == 7
    assert 7 not in fm.ack_map
