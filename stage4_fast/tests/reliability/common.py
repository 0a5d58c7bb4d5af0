"""Helpers of the reliability tests: the scheduler's stats and its idle state."""

from __future__ import annotations

import time

import httpx

from stage4_fast.harness import ServerProcess


def stats(server: ServerProcess, headers: dict | None = None) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def is_idle(s: dict) -> bool:
    return (s["running_reqs"] == 0 and s["pending_reqs"] == 0 and s["locked_nodes"] == 0
            and s["protected_tokens"] == 0 and s["free_pages"] + s["evictable_pages"] == s["num_pages"]
            and s["free_req_slots"] == s["max_running_req"])


def wait_idle(server: ServerProcess, timeout_s: float = 30.0, headers: dict | None = None) -> dict:
    """Poll until nothing runs, waits or is locked and every page is free or only cached; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        full = stats(server, headers)
        s = full["scheduler"]
        if is_idle(s) and full["frontend"]["inflight_requests"] == 0:
            return s
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {full}"
        time.sleep(0.05)
