"""Many clients at once: every stream completes with the offline engine's text; clients that leave mid-stream
give back every KV page."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import torch

from stage3_served.core import SamplingParams
from stage3_served.harness import ServerProcess

from .conftest import TINY_SERVER_OPTIONS


def _prompts(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud seven north quiet amber violin".split()
    return [(f"Request {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 60))), rng.randint(4, 40))
            for i in range(n)]


@pytest.fixture(scope="module")
def offline_texts(tiny_dir):
    """What the offline engine answers (greedy, EOS ignored), computed once in this process."""
    from stage3_served.llm import LLM

    prompts = _prompts(32, seed=5)
    llm = LLM(str(tiny_dir), dtype=torch.float32, **{k: v for k, v in _engine_options().items()})
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in prompts]
    out = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    return prompts, [o["text"] for o in out]


def _engine_options() -> dict:
    o = dict(TINY_SERVER_OPTIONS)
    return dict(num_page_override=o["num_pages"], page_size=o["page_size"], max_running_req=o["max_running_req"],
                cache_type=o["cache_type"])


async def _stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, list[dict]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        done = False
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[len("data: "):]))
        assert done
    return "".join(e["choices"][0]["text"] for e in events), events


def test_32_concurrent_streams_all_complete_with_the_offline_text(tiny_server: ServerProcess, offline_texts):
    prompts, want = offline_texts

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
            return await asyncio.gather(*[_stream_completion(client, p, n) for p, n in prompts])

    results = asyncio.run(main())
    for i, ((text, events), expected) in enumerate(zip(results, want)):
        assert text == expected, f"request {i}"
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert len({e["id"] for e in events}) == 1
    assert len({events[0]["id"] for _, events in results}) == len(results)


def _stats(server: ServerProcess) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> dict:
    """The scheduler back at rest: nothing running or queued, every page free or evictable, nothing locked."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = _stats(server)["scheduler"]
        idle = (s["running_reqs"] == 0 and s["pending_reqs"] == 0 and s["locked_nodes"] == 0
                and s["protected_tokens"] == 0 and s["free_pages"] + s["evictable_pages"] == s["num_pages"]
                and s["free_req_slots"] == s["max_running_req"])
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def _assert_idle(s: dict) -> None:
    assert s["running_reqs"] == 0 and s["pending_reqs"] == 0, s
    assert s["locked_nodes"] == 0 and s["protected_tokens"] == 0, s
    assert s["free_pages"] + s["evictable_pages"] == s["num_pages"] == TINY_SERVER_OPTIONS["num_pages"], s
    assert s["free_req_slots"] == s["max_running_req"], s


def test_20_clients_leaving_mid_stream_free_all_pages(tiny_server: ServerProcess):
    before = _wait_idle(tiny_server)
    _assert_idle(before)

    async def leave_after_two_chunks(i: int) -> int:
        body = {"prompt": f"client {i} " * (5 + i), "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if chunks == 2:
                            break  # leaving the block closes the connection mid-stream
        return chunks

    async def main():
        return await asyncio.gather(*[leave_after_two_chunks(i) for i in range(20)])

    assert asyncio.run(main()) == [2] * 20
    after = _wait_idle(tiny_server)
    _assert_idle(after)
    assert after["aborted_reqs"] - before["aborted_reqs"] == 20  # none ran to its end: each was aborted
    assert _stats(tiny_server)["frontend"]["inflight_requests"] == 0


def test_client_that_gives_up_on_a_plain_request_aborts_it(tiny_server: ServerProcess):
    before = _wait_idle(tiny_server)
    body = {"prompt": "wait for me", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=1.0)
    after = _wait_idle(tiny_server)
    _assert_idle(after)
    assert after["aborted_reqs"] == before["aborted_reqs"] + 1


def test_stats_are_readable_by_an_operator(tiny_server: ServerProcess):
    s = _stats(tiny_server)
    for key in ("num_pages", "free_pages", "evictable_pages", "page_size", "locked_nodes", "protected_tokens",
                "running_reqs", "pending_reqs", "free_req_slots", "max_running_req", "cache_type", "aborted_reqs"):
        assert key in s["scheduler"], key
    assert s["scheduler"]["page_size"] == TINY_SERVER_OPTIONS["page_size"]


def test_bursts_from_one_client_keep_their_connections_across_an_idle_gap(tiny_server: ServerProcess):
    """The client shape that once lost a stream: one process, one AsyncClient with a small pool, bursts of streams
    in a row on the same keep-alive connections. Between two bursts the connections idle past uvicorn's default
    keep-alive (5 s, httpx's own expiry too): were the server to close them then, a request sent as one closes is
    lost (ReadError). The server holds them open (--timeout-keep-alive), so every burst reuses the first burst's
    connections and every stream ends with [DONE]."""
    pool, streams, idle_s = 8, 64, 5.5

    async def burst(client: httpx.AsyncClient) -> set[int]:
        async def one(i: int) -> int:
            body = {"prompt": f"burst {i}", "max_tokens": 2, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
                assert [line async for line in r.aiter_lines() if line][-1] == "data: [DONE]"
            return port

        return set(await asyncio.gather(*(one(i) for i in range(streams))))

    async def main() -> list[set[int]]:
        limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool, keepalive_expiry=60)
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120, limits=limits) as client:
            first = await burst(client)
            second = await burst(client)  # at once: connections reused straight away
            await asyncio.sleep(idle_s)
            return [first, second, await burst(client)]

    first, second, after_idle = asyncio.run(main())
    assert len(first) <= pool
    assert second <= first and after_idle <= first, "the server closed idle keep-alive connections"
