"""SIGTERM with streams in flight: each stream ends with an error event and [DONE] (not silence), every process is
gone and the port is free again. (test_server_lifecycle.py covers idle shutdown, SIGINT and a dying worker.)"""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import httpx
import psutil

from stage3_served.harness import server_process

STREAMS = 4


def test_sigterm_ends_in_flight_streams_with_an_error_event(tiny_dir):
    with server_process(str(tiny_dir)) as server:
        workers = psutil.Process(server.proc.pid).children(recursive=True)
        port = int(server.base_url.rsplit(":", 1)[1])
        body = {"prompt": "keep talking", "max_tokens": 3000, "ignore_eos": True, "stream": True}

        async def one(client: httpx.AsyncClient, started: asyncio.Event, n_started: list[int]) -> list[str]:
            lines: list[str] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line:  # SSE's blank separator lines
                        continue
                    lines.append(line)
                    if len(lines) == 1:  # this stream has started (counted once: SIGTERM waits for all of them)
                        n_started[0] += 1
                        if n_started[0] == STREAMS:
                            started.set()
            return lines

        async def main() -> list[list[str]]:
            started, n_started = asyncio.Event(), [0]
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                tasks = [asyncio.create_task(one(client, started, n_started)) for _ in range(STREAMS)]
                await asyncio.wait_for(started.wait(), 60)
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        assert server.proc.wait(30) == 0
        for lines in results:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][len("data: "):])
            assert last["error"]["type"] == "server_error" and "shutting down" in last["error"]["message"], last
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
        with socket.socket() as s:  # the port is released
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        assert "Traceback" not in server.log()
