"""The benchmark's HTTP client: one streamed `/v1/completions` request and what its chunks say.

Two libraries can carry it. aiohttp is the default, as in SGLang's and vLLM's serving benchmarks
(`sglang.bench_serving`, `vllm bench serve`). httpx (the OpenAI SDK's library) is kept for comparison: its
connection pool scans every pending request and connection on each request and response event, so with hundreds of
streams in one process its CPU time per request grows with their number, and a burst of hundreds of streams would
measure the client as much as the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Protocol

HTTP_CLIENTS = ("aiohttp", "httpx")
DEFAULT_HTTP_CLIENT = "aiohttp"


class LineStream(Protocol):
    def lines(self, url: str, body: dict) -> AsyncIterator[str]:
        """POSTs `body` as JSON and yields the response's lines (an error status raises)."""

    async def open_connections(self, url: str, count: int) -> None:
        """Opens `count` keep-alive connections to the server (`count` GET /health at once), which the client's
        pool then lends to the requests that follow."""


class _Aiohttp:
    def __init__(self, session) -> None:
        self.session = session

    async def lines(self, url: str, body: dict) -> AsyncIterator[str]:
        async with self.session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for raw in resp.content:  # one line per item, its newline included
                yield raw.decode()

    async def open_connections(self, url: str, count: int) -> None:
        async def probe() -> None:
            async with self.session.get(url + "/health") as resp:
                await resp.read()

        await asyncio.gather(*(probe() for _ in range(count)))


class _Httpx:
    def __init__(self, client) -> None:
        self.client = client

    async def lines(self, url: str, body: dict) -> AsyncIterator[str]:
        async with self.client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                yield line

    async def open_connections(self, url: str, count: int) -> None:
        await asyncio.gather(*(self.client.get(url + "/health") for _ in range(count)))


@contextlib.asynccontextmanager
async def open_client(kind: str, connections: int) -> AsyncIterator[LineStream]:
    """A client that keeps up to `connections` connections open (one per concurrent stream)."""
    if kind == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
            yield _Aiohttp(session)
    elif kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=connections)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
            yield _Httpx(client)
    else:
        raise ValueError(f"unknown HTTP client {kind!r}; one of {HTTP_CLIENTS}")


async def stream_completion(client: LineStream, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion of `max_tokens` tokens (greedy, EOS ignored): when each chunk with text arrived,
    relative to the request's start, and the completion tokens the usage chunk reports."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, tokens = [], None
    async for line in client.lines(url + "/v1/completions", body):
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        data = json.loads(line[5:])
        if data.get("choices"):
            chunks.append(time.perf_counter() - t0)
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
    # TPOT = per-token decode time of this request; ITL = gaps between chunks (a chunk can carry more than one
    # token when the detokenizer holds back an incomplete UTF-8 character)
    tpot = (chunks[-1] - chunks[0]) / (tokens - 1) if tokens and tokens > 1 else None
    return {"ttft": chunks[0], "itl": [b - a for a, b in zip(chunks, chunks[1:])], "tokens": tokens,
            "chunks": len(chunks), "tpot": tpot, "latency": chunks[-1]}
