"""`python -m bench worker`: an in-process engine gives its memory back before a server task starts (the server
sizes its KV pool from the free GPU memory), and a later engine task loads a fresh one."""

from __future__ import annotations

import argparse
import subprocess
import sys
import weakref
from pathlib import Path

from bench import worker

REPO = Path(__file__).resolve().parents[2]


def _args(tasks: str, model: str) -> argparse.Namespace:
    return argparse.Namespace(task=tasks, stage="stage4_fast", model=model, options="{}", quick=True, gpu=False,
                              log=None, http_client="aiohttp", cold_connections=False)


def test_engine_collected_before_a_server_task(monkeypatch):
    """The real stage-4 engine: when the server task starts, nothing keeps the offline engine's KV pool alive (the
    worker once collected while it still held the engine itself, so the pool outlived the shutdown)."""
    tiny = REPO / "models" / "tiny-qwen3"
    if not (tiny / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", "tiny-qwen3"], cwd=REPO, check=True)
    events: list[str] = []
    pools: list[weakref.ref] = []

    def offline(adapter, w):
        pools.append(weakref.ref(adapter.llm.engine.ctx.kv_cache))
        events.append("offline")
        return {"tok_s": 1.0}

    def serve_offline(*args, **kwargs):
        assert all(pool() is None for pool in pools), "a server started while the engine's KV pool was alive"
        events.append("serve")
        return {"tok_s": 1.0}

    monkeypatch.setattr(worker, "task_offline", offline)
    monkeypatch.setattr(worker, "task_serve_offline", serve_offline)
    result = worker.run(_args("offline,serve_offline,offline", str(tiny)))
    assert events == ["offline", "serve", "offline"]  # the second offline task loaded a new engine
    assert len(pools) == 2 and pools[0]() is None
    assert set(result["tasks"]) == {"offline", "serve_offline"}
