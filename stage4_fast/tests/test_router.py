"""Data-parallel replicas behind SGLang's router (`sglang-router` from PyPI, a Rust load balancer for
OpenAI-compatible workers): two CPU replicas, round robin; each answer equals HF and both replicas serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from typing import Iterator, List

import httpx
import pytest

from stage4_fast.harness import ServerProcess, free_port, server_process

from .conftest import prepared_model
from .fast_helpers import hf_generate

pytest.importorskip("sglang_router", reason="pip install sglang-router (the test extra installs it on Linux)")

PROMPTS = ["The capital of France is", "One, two, three,", "Once upon a time", "def add(a, b):"]
NEW_TOKENS = 8


@contextmanager
def router(worker_urls: List[str], startup_timeout_s: float = 120.0) -> Iterator[str]:
    """`python -m sglang_router.launch_router --worker-urls ... --policy round_robin` on a free port, ready (both
    workers registered and healthy) on entry, stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while not _workers_ready(url, len(worker_urls)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the router did not come up (exit code {proc.poll()}):\n"
                                       + log.read().decode(errors="replace")[-3000:])
                time.sleep(0.5)
            yield url
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _workers_ready(url: str, n: int) -> bool:
    try:
        workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return sum(w["is_healthy"] for w in workers) == n


def _served(replica: ServerProcess) -> int:
    return replica.log().count('"POST /v1/completions HTTP/1.1" 200')


def test_two_replicas_behind_sglang_router_equal_hf():
    model = prepared_model("tiny-qwen3")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    want = [tokenizer.decode(ids) for ids in hf_generate(model, [tokenizer.encode(p) for p in PROMPTS], NEW_TOKENS)]
    with ExitStack() as stack:
        replicas = [stack.enter_context(server_process(str(model), num_pages=256)) for _ in range(2)]
        url = stack.enter_context(router([r.base_url for r in replicas]))
        got = []
        for prompt in PROMPTS:  # the router parses the body itself: text prompts (it refuses token-id lists)
            resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            got.append(resp.json()["choices"][0]["text"])
        assert got == want
        assert [_served(r) for r in replicas] == [2, 2]  # round robin over both replicas
        # streaming passes through the router unchanged (server-sent events, [DONE] last)
        body = {"model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert resp.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 3
