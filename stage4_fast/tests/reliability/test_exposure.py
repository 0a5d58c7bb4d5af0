"""Auth, body size limit, bounded queue, KV exhaustion and /metrics on one small server (key from the environment)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stage4_fast.harness import ServerProcess, server_process

from .common import wait_idle

KEY = "sk-reliability-7f3a9"
MARKER = "ZEBRAQUOKKA"  # in every prompt: must never reach the log at INFO
MAX_BYTES = 16384
# 2 running + 2 queued requests at once; 256 pages of 4 tokens = 1024 KV slots
RUNNING, QUEUED, PAGES, PAGE = 2, 2, 256, 4
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_dir) -> ServerProcess:
    os.environ["MINISGL_API_KEY"] = KEY  # the server process inherits it (the flag's default)
    try:
        with server_process(str(tiny_dir), num_pages=PAGES, page_size=PAGE, max_running_req=RUNNING,
                            extra_args=["--max-request-bytes", str(MAX_BYTES),
                                        "--max-queued-requests", str(QUEUED)]) as s:
            yield s
    finally:
        del os.environ["MINISGL_API_KEY"]


def _complete(base: str, prompt: str, max_tokens: int, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_every_endpoint_but_health_needs_the_key(server):
    base = server.base_url
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    doc = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=10).json()
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops] + [
        ("GET", "/openapi.json"), ("GET", "/docs"), ("POST", "/v1"), ("GET", "/nope")]
    assert len(routes) >= 8
    for method, path in routes:
        if path == "/health":
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{base}{path}", headers=headers, json={"prompt": MARKER}, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_oversized_bodies_get_413(server):
    big = {"prompt": MARKER + "x" * MAX_BYTES, "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/completions", json=big, headers=AUTH, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies to the bytes as they arrive
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 512 + 1):
            yield b"y" * 512
        yield b'", "max_tokens": 2}'

    r = httpx.post(f"{server.base_url}/v1/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert _complete(server.base_url, "small " + MARKER, 2).status_code == 200


def _inflight(client_metrics: str) -> float:
    for family in text_string_to_metric_families(client_metrics):
        if family.name == "minisgl_num_inflight_requests":
            return family.samples[0].value
    raise AssertionError("no minisgl_num_inflight_requests")


def test_a_full_queue_answers_503_with_retry_after(server):
    # each holder needs ~1000 of the 1024 KV slots: one decodes 1000 tokens while the others wait in the queue
    body = {"prompt": f"hold {MARKER}", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def hold(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            holders = [asyncio.create_task(hold(client)) for _ in range(RUNNING + QUEUED)]
            for _ in range(200):  # until the API server has admitted all of them
                if _inflight((await client.get("/metrics")).text) == RUNNING + QUEUED:
                    break
                await asyncio.sleep(0.02)
            extra = await asyncio.gather(*[client.post("/v1/completions", json={**body, "stream": s})
                                           for s in (False, True, False)])
            assert not any(h.done() for h in holders)  # they were still in flight when the extras came
            for h in holders:
                h.cancel()  # the clients leave: their requests are aborted
            await asyncio.gather(*holders, return_exceptions=True)
            return extra

    for r in asyncio.run(main()):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    wait_idle(server, headers=AUTH)
    assert _complete(server.base_url, "after the rush " + MARKER, 3).status_code == 200


def test_kv_demand_beyond_the_pool_queues_and_completes_but_an_impossible_request_gets_400(server):
    # each needs ~320 of the 1024 slots: together they exceed the pool, so they wait for each other
    prompts = [f"{MARKER} {i} " + "word " * 300 for i in range(RUNNING + QUEUED)]

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*[
                client.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "ignore_eos": True})
                for p in prompts])

    results = asyncio.run(main())
    assert [r.status_code for r in results] == [200] * len(prompts), [r.text for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in results)
    # alone bigger than the whole pool: refused at once, not queued forever
    r = _complete(server.base_url, MARKER + " big" * 1100, 8)
    assert r.status_code == 400, r.text
    assert "pool" in r.json()["error"]["message"] or "context" in r.json()["error"]["message"]
    wait_idle(server, headers=AUTH)


def test_metrics_in_prometheus_format(server):
    assert _complete(server.base_url, "metrics " + MARKER, 5, stream=True).status_code == 200
    r = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    ok = samples[("minisgl_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))]
    assert ok >= 1 + RUNNING + QUEUED
    assert samples[("minisgl_http_requests_total", (("endpoint", "/v1/completions"), ("status", "503")))] >= 3
    assert samples[("minisgl_http_requests_total", (("endpoint", "/v1/models"), ("status", "401")))] >= 3
    assert samples[("minisgl_http_requests_total", (("endpoint", "other"), ("status", "401")))] >= 3
    assert samples[("minisgl_rejected_requests_total", ())] >= 3
    assert samples[("minisgl_prompt_tokens_total", ())] > 0
    assert samples[("minisgl_generation_tokens_total", ())] >= 5 + 16 * (RUNNING + QUEUED)
    assert samples[("minisgl_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("minisgl_inter_token_latency_seconds_count", ())] >= 4
    assert samples[("minisgl_kv_pages_total", ())] == PAGES
    assert 0 < samples[("minisgl_kv_pages_free", ())] <= PAGES
    assert samples[("minisgl_num_queued_requests", ())] == 0
    assert samples[("minisgl_num_running_requests", ())] == 0


def test_prompts_and_key_never_reach_the_log(server):
    log = server.log()
    assert "POST /v1/completions" in log  # the log is there (INFO access lines) ...
    assert KEY not in log and MARKER not in log  # ... without secrets or prompts
