"""--stream-interval (SGLang's flag): a request's tokens leave the scheduler every N steps, its first and last at once,
every token in order; the server streams the same text."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Dict, List

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage4_fast.harness import server_process
from stage4_fast.message import AbortBackendMsg, DetokenizeMsg
from stage4_fast.scheduler.stream_interval import StreamInterval

from .conftest import TINY_SERVER_OPTIONS
from .helpers import assert_pool_accounted, greedy, make_llm


def _msg(uid: int, token: int, first: bool = False, last: bool = False) -> DetokenizeMsg:
    return DetokenizeMsg(uid, token, last, finish_reason="length" if last else "", prompt_tokens=5 if first else 0)


def test_interval_one_sends_every_step_as_it_is():
    out = StreamInterval(1)
    reply = [_msg(0, 7, first=True), _msg(1, 8)]
    assert out.step(reply) is reply and out.held == 0


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        StreamInterval(0)


@settings(max_examples=80, deadline=None)
@given(st.integers(min_value=2, max_value=5), st.lists(st.tuples(st.integers(0, 12), st.integers(1, 9)),
                                                      min_size=1, max_size=6))
def test_tokens_leave_every_n_steps_in_order_first_and_last_at_once(interval, requests):
    """Requests (start step, tokens) stream one token per step: each request's messages leave in order; its first
    and last in the step that made them; any other one in the first step from its own that is a multiple of N or
    in which the request's last token leaves."""
    out = StreamInterval(interval)
    made: Dict[int, int] = {}  # message id -> the step that made it
    sent: Dict[int, int] = {}  # message id -> the step that sent it
    order: Dict[int, List[int]] = {uid: [] for uid in range(len(requests))}
    last_step = {uid: start + n - 1 for uid, (start, n) in enumerate(requests)}
    ids = itertools.count()
    for step in range(1, max(last_step.values()) + 2):
        reply = []
        for uid, (start, n) in enumerate(requests):
            if start + 1 <= step <= start + n:
                k = step - start - 1
                reply.append(_msg(uid, next(ids), first=k == 0, last=k == n - 1))
                made[reply[-1].next_token] = step
        for m in out.step(reply):
            sent[m.next_token] = step
            order[m.uid].append(m.next_token)
    assert out.held == 0
    assert sorted(sent) == sorted(made)
    for uid in range(len(requests)):
        assert order[uid] == sorted(order[uid])  # in the order made
        tokens = order[uid]
        first, last = tokens[0], tokens[-1]
        assert sent[first] == made[first] and sent[last] == made[last]
        for t in tokens[1:-1]:
            due = next(s for s in itertools.count(made[t]) if s % interval == 0 or s == made[last])
            assert sent[t] == due


def test_an_abort_takes_the_requests_held_tokens_first():
    out = StreamInterval(4)
    assert out.step([_msg(0, 1, first=True), _msg(1, 2, first=True)]) != []
    assert out.step([_msg(0, 3), _msg(1, 4)]) == []
    assert out.step([_msg(0, 5), _msg(1, 6)]) == []
    assert [m.next_token for m in out.release({1})] == [4, 6]
    assert [m.next_token for m in out.release({0})] == [3, 5] and out.held == 0


def test_the_llm_with_an_interval_gives_the_same_tokens_and_sends_less_often(tiny_model):
    """Offline, the scheduler's results go to the LLM in-process: with N = 3 the same tokens for every request,
    and an abort at a random step still ends its request (tokens a prefix of the plain run's) and leaves the pool
    whole."""
    rng = random.Random(0)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    max_tokens = [rng.randint(4, 16) for _ in prompts]
    victim = max_tokens.index(max(max_tokens))  # aborted at step 3, long before its last token
    sends: Dict[int, int] = {}
    results = {}
    for interval in (1, 3):
        llm = make_llm(tiny_model("qwen3"), stream_interval=interval, max_running_req=4, page_size=4,
                       num_page_override=64)
        inner_send = llm.send_result

        def counting_send(reply, interval=interval, inner_send=inner_send):
            sends[interval] = sends.get(interval, 0) + 1
            inner_send(reply)

        llm.send_result = counting_send  # type: ignore[method-assign]
        out = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        results[interval] = [o["token_ids"] for o in out]
        del llm.send_result
        steps = itertools.count()
        inner = llm.receive_msg

        def receive_msg(blocking: bool = False, inner=inner, steps=steps):
            msgs = inner(blocking=blocking)
            if next(steps) == 3:
                msgs.append(AbortBackendMsg(victim))
            return msgs

        llm.receive_msg = receive_msg  # type: ignore[method-assign]
        aborted = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        del llm.receive_msg
        assert aborted[victim].get("error") == "aborted"
        assert aborted[victim]["token_ids"] == results[interval][victim][: len(aborted[victim]["token_ids"])]
        assert [o["token_ids"] for i, o in enumerate(aborted) if i != victim] == \
            [t for i, t in enumerate(results[interval]) if i != victim]
        assert_pool_accounted(llm)
        llm.shutdown()
    assert results[3] == results[1]
    assert sends[3] < sends[1]


def _stream(base_url: str, prompt: List[int], max_tokens: int) -> List[str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    texts = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["text"]:
                    texts.append(choices[0]["text"])
    return texts


def test_the_server_streams_the_same_text_with_an_interval(tiny_dir: Path):
    """`--stream-interval 4` on the server: the streamed text is the plain completion's. (How many chunks it takes
    depends on the API server's pace as well: it merges the replies that queued up for a request, and a tiny model on
    a CPU finishes before the first chunk goes out; `python -m bench serve-path` measures the chunks.)"""
    prompt, n = list(range(500, 530)), 24
    with server_process(str(tiny_dir), extra_args=["--stream-interval", "4"], **TINY_SERVER_OPTIONS) as server:
        chunks = _stream(server.base_url, prompt, n)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert chunks and "".join(chunks) == plain
